"""How long a checkpoint save holds up the training loop: synchronous `dcp.save` against
`checkpoint.async_save=true` (`dcp.async_save`: the loop waits only for the copy to memory),
in one run, alternating, as medians and a ratio.

    .venv/bin/python benchmarks/checkpoint.py [--repeats 3] [--width 1024]

Model: deep_mlp at the given width (1024: ~8.4 M parameters, ~100 MB of model and Adam state
across 2 ranks of DDP), a checkpoint every 10 of 60 steps. `checkpoint_blocked_s` in
summary.json is rank 0's median time per save spent outside training steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import dtf_summary

COMMON = [
    "model=deep_mlp",
    "optimizer=adam",
    "trainer.progress=off",
    "trainer.export_weights=false",
    "trainer.max_steps=60",
    "checkpoint.every_n_steps=10",
    "checkpoint.at_end=false",
    "data.dataset.num_points=4000",
    "data.dataset.num_test=200",
]


def run(run_dir: Path, width: int, async_save: bool) -> dict:
    return dtf_summary(run_dir, [*COMMON, f"model.width={width}", f"checkpoint.async_save={str(async_save).lower()}"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=1024)
    a = p.parse_args()
    blocked: dict[bool, list[float]] = {False: [], True: []}
    steps: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for async_save in (False, True):
                s = run(Path(tmp) / f"{i}-{async_save}", a.width, async_save)
                blocked[async_save].append(s["checkpoint_blocked_s"])
                steps[async_save].append(s["step_time_s"])
                print(
                    f"repeat {i} async={async_save}: blocked {s['checkpoint_blocked_s'] * 1e3:.1f} ms per save, "
                    f"{s['checkpoints_saved']} saves, step {s['step_time_s'] * 1e3:.1f} ms",
                    flush=True,
                )
    sync_ms, async_ms = (statistics.median(blocked[k]) * 1e3 for k in (False, True))
    print(
        f"\nmedian time the loop is blocked per save: sync {sync_ms:.1f} ms, async {async_ms:.1f} ms, "
        f"ratio async/sync {async_ms / sync_ms:.3f}"
    )
    print(
        f"median step time: sync {statistics.median(steps[False]) * 1e3:.1f} ms, "
        f"async {statistics.median(steps[True]) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
