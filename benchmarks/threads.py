"""One rank with 2 intra-op threads against 1, alternating, on this machine (issue 31, item 8).

    .venv/bin/python benchmarks/threads.py [--repeats 4] [overrides ...]
    .venv/bin/python benchmarks/threads.py --repeats 3 +experiment=digits_cnn trainer.max_epochs=2

Each repeat runs the same 1-rank job with launcher.env.OMP_NUM_THREADS=2 and =1 in turn (so that
machine load hits both alike) and prints its median step time, the first characters of its
params_sha256 (equal digests: the same result bit for bit) and the 1-minute load average, which on
a shared machine says how much the figures mean.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from common import dtf_summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("overrides", nargs="*", default=["trainer.max_epochs=2"])
    args = parser.parse_args()
    found: dict[int, list[tuple[float, str, float]]] = {2: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for threads in (2, 1):
                overrides = [
                    "launcher.nproc=1",
                    f"+launcher.env.OMP_NUM_THREADS={threads}",
                    "trainer.progress=off",
                    "checkpoint.every_n_steps=null",
                    "checkpoint.at_end=false",
                    *args.overrides,
                ]
                s = dtf_summary(Path(tmp) / f"run{i}_{threads}", overrides)
                found[threads].append((s["step_time_s"], s["params_sha256"][:12], os.getloadavg()[0]))
                print(f"repeat {i + 1}, {threads} thread(s): {s['step_time_s'] * 1e3:.3f} ms/step", flush=True)
    for threads, runs in found.items():
        print(
            f"{threads} thread(s): median step {statistics.median(r[0] for r in runs) * 1e3:.3f} ms, "
            f"digests {sorted({r[1] for r in runs})}, load {[round(r[2], 1) for r in runs]}"
        )
    ratio = statistics.median(a[0] / b[0] for a, b in zip(found[2], found[1], strict=True))
    print(f"2 threads / 1 thread: median step ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
