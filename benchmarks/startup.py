"""What starting a run costs: `python -m dtf debug=fast` (2 optimizer steps, 2 evaluation batches)
with its ranks forked from a preloaded forkserver (launcher.start_method=forkserver, the default)
and spawned (=spawn, torchrun's way), against the floor: torchrun starting the same number of
ranks of a hand-written script that imports torch, joins a gloo group and takes 2 DDP steps.

    .venv/bin/python benchmarks/startup.py [--repeats 5] [--nproc 2 4]

Each repeat runs the three in turn (so that machine load hits them alike) and measures the
command's wall time and the CPU time the whole machine spent meanwhile (/proc/stat: run it on an
otherwise idle machine; the 1-minute load average is printed). Medians, and ratios to the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO

FLOOR_SCRIPT = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = DDP(torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.Adam(model.parameters())
for _ in range(2):
    opt.zero_grad()
    model(torch.randn(32, 2)).pow(2).mean().backward()
    opt.step()
dist.destroy_process_group()
"""


def busy_seconds() -> float:
    """CPU seconds the machine has spent so far (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def measure(cmd: list[str], cwd: Path) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cpu, wall = busy_seconds(), time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=cwd, env=env)
    return time.perf_counter() - wall, busy_seconds() - cpu


def commands(nproc: int, run_dir: Path, floor: Path) -> dict[str, list[str]]:
    dtf = [sys.executable, "-m", "dtf", "debug=fast", f"launcher.nproc={nproc}", "trainer.progress=off"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return {
        "dtf, forkserver": [*dtf, f"hydra.run.dir={run_dir}_fork"],
        "dtf, spawn": [*dtf, "launcher.start_method=spawn", f"hydra.run.dir={run_dir}_spawn"],
        "torchrun floor": [*torchrun, str(floor)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; load {os.getloadavg()[0]:.2f} at the start", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "floor.py").write_text(FLOOR_SCRIPT)
        for nproc in args.nproc:
            found: dict[str, list[tuple[float, float]]] = {}
            for i in range(args.repeats):
                for name, cmd in commands(nproc, work / f"run{nproc}_{i}", work / "floor.py").items():
                    found.setdefault(name, []).append(measure(cmd, work))
            floor_wall = statistics.median(w for w, _ in found["torchrun floor"])
            floor_cpu = statistics.median(c for _, c in found["torchrun floor"])
            print(f"{nproc} ranks, median of {args.repeats}:")
            for name, runs in found.items():
                wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
                print(
                    f"  {name:16s} wall {wall:6.2f} s ({wall / floor_wall:.2f} x the floor), "
                    f"CPU {cpu:6.2f} s ({cpu / floor_cpu:.2f} x)",
                    flush=True,
                )
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
