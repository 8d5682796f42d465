"""Wall time of a hyperparameter search: Hydra's basic sweeper over a grid, one point after the
other, against hydra/sweeper=dtf with two trials at a time and the median rule pruning, over the
same range, the same number of trials, on the same machine, in one run.

    .venv/bin/python benchmarks/sweep.py [--trials 8] [--epochs 4] [--nproc 1] [--parallel 2]

Both search optimizer.lr in [1e-6, 1e-1] (the grid: log-spaced points; dtf: Optuna's TPE,
seeded) on the default job. Prints each sweep's wall time, trials pruned and best test loss,
and writes both sweeps' reports (python -m dtf.sweep.report) next to them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOW, HIGH = 1e-6, 1e-1


def sweep(args: list[str], sweep_dir: Path) -> float:
    """Runs python -m dtf -m <args> into sweep_dir; returns its wall time in seconds."""
    cmd = [sys.executable, "-m", "dtf", "-m", *args, "trainer.progress=off", f"hydra.sweep.dir={sweep_dir}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def outcome(sweep_dir: Path) -> tuple[int, float]:
    """(trials pruned, best final test loss of the trials that finished)."""
    pruned, best = 0, float("inf")
    for summary_file in sweep_dir.glob("*/summary.json"):
        s = json.loads(summary_file.read_text())
        if s.get("pruned"):
            pruned += 1
        elif s["objective"] is not None:
            best = min(best, s["objective"])
    return pruned, best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--nproc", type=int, default=1, help="ranks per trial")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="keep the sweeps here (default: a temporary dir)")
    args = p.parse_args()
    common = [f"trainer.max_epochs={args.epochs}", f"launcher.nproc={args.nproc}"]
    grid = [LOW * (HIGH / LOW) ** (i / (args.trials - 1)) for i in range(args.trials)]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        grid_s = sweep([*common, "optimizer.lr=" + ",".join(f"{lr:.3g}" for lr in grid)], root / "grid")
        dtf_s = sweep(
            [
                *common,
                "hydra/sweeper=dtf",
                f"hydra.sweeper.n_trials={args.trials}",
                f"hydra.sweeper.parallel={args.parallel}",
                "hydra.sweeper.sampler.seed=0",
                "hydra.sweeper.pruner=median",
                "+hydra.sweeper.pruner_options={n_startup_trials:2}",
                f"optimizer.lr=tag(log,interval({LOW},{HIGH}))",
            ],
            root / "dtf",
        )
        rows = [("grid, one at a time", grid_s, *outcome(root / "grid"))]
        rows.append((f"dtf, {args.parallel} at a time, median", dtf_s, *outcome(root / "dtf")))
    print(f"{args.trials} trials of {args.epochs} epochs on {args.nproc} rank(s) each, optimizer.lr in [{LOW}, {HIGH}]")
    print(f"{'sweep':34}{'wall s':>9}{'pruned':>8}{'best test loss':>16}")
    for name, seconds, pruned, best in rows:
        print(f"{name:34}{seconds:>9.1f}{pruned:>8}{best:>16.6g}")
    print(f"ratio dtf / grid (wall time): {dtf_s / grid_s:.2f}")


if __name__ == "__main__":
    main()
