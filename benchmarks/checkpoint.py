"""How long a checkpoint save holds up the training loop: synchronous `dcp.save` against
`checkpoint.async_save=true` (`dcp.async_save`: the loop waits only for the copy to memory),
in one run, alternating, as medians and a ratio.

    .venv/bin/python benchmarks/checkpoint.py [--repeats 3] [--width 1024]

Model: deep_mlp at the given width (1024: ~8.4 M parameters, ~100 MB of model and Adam state
across 2 ranks of DDP), a checkpoint every 10 of 60 steps. `checkpoint_blocked_s` in
summary.json is rank 0's median time per save spent outside training steps. It also times the
integrity checksums (CRC32 of every file: computed at each commit, verified before a resume) on
one of the checkpoints written.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
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
            if i == 0:
                checksum_ms = checksum_cost(Path(tmp) / "0-False" / "checkpoints")
    sync_ms, async_ms = (statistics.median(blocked[k]) * 1e3 for k in (False, True))
    print(
        f"\nmedian time the loop is blocked per save: sync {sync_ms:.1f} ms, async {async_ms:.1f} ms, "
        f"ratio async/sync {async_ms / sync_ms:.3f}"
    )
    print(
        f"median step time: sync {statistics.median(steps[False]) * 1e3:.1f} ms, "
        f"async {statistics.median(steps[True]) * 1e3:.1f} ms"
    )
    size_mb, crc_ms, verify_ms = checksum_ms
    print(
        f"integrity checksums on a {size_mb:.0f} MB checkpoint: CRC32 of all its files {crc_ms:.1f} ms in one process "
        f"(at a commit each rank checksums its own files), verify before a resume {verify_ms:.1f} ms"
    )


def checksum_cost(root: Path) -> tuple[float, float, float]:
    """(MB, ms to checksum every file, ms to verify the checkpoint): medians of 5, page cache warm."""
    from dtf.train.checkpoint import committed, file_crc32, verify

    path = committed(root)[0]
    files = [f for f in path.iterdir() if f.is_file()]
    size = sum(f.stat().st_size for f in files) / 2**20

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return size, timed(lambda: [file_crc32(f) for f in files]), timed(lambda: verify(path))


if __name__ == "__main__":
    main()
