"""Step time of the default job: 2 ranks on one host against 1 rank on each of two hosts, in one run.

    .venv/bin/python benchmarks/multinode.py [--repeats 5] [--epochs 5]

The "hosts" are network namespaces on a bridge inside this machine (scripts/local-hosts.sh), so
they share its cores: each rank gets one thread on both sides. And
the two-host runs' gloo traffic crosses a veth pair and a bridge instead of loopback: what the
difference shows is the network stack, not a network. Both sides run inside the namespaces
(the one-host runs on the first host), alternating, and the verdict is the median of the paired
ratios two hosts / one host, with their quartiles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ROOT / "scripts" / "local-hosts.sh"


def on_host(host: str, overrides: list[str]) -> subprocess.Popen[str]:
    cmd = ["bash", str(HOSTS), "run", host, sys.executable, "-m", "dtf", *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen[str]], run_dir: Path) -> dict:
    for proc in procs:
        _, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            sys.exit(f"a run failed (exit {proc.returncode}):\n{err[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=int, default=5)
    args = p.parse_args()
    started = subprocess.run(["bash", str(HOSTS), "start", "2"], capture_output=True, text=True)
    if started.returncode != 0:
        sys.exit(f"scripts/local-hosts.sh start failed: {started.stderr.strip()}")
    hosts = started.stdout.strip().split("=", 1)[1].strip('"').split()
    common = [f"trainer.max_epochs={args.epochs}", "trainer.progress=off", "trainer.export_weights=false"]
    one, two = [], []
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in range(args.repeats):
                run_dir = Path(d) / f"one{i}"
                one.append(
                    finish([on_host(hosts[0], [*common, "launcher.nproc=2", f"hydra.run.dir={run_dir}"])], run_dir)
                )
                run_dir = Path(d) / f"two{i}"
                nodes = [*common, "launcher.nproc=1", "launcher.nnodes=2", f"launcher.rdzv_endpoint={hosts[0]}:29500"]
                # Each "host" would take all of this machine's cores for its one rank: they share
                # them, one thread per rank, as the one-host run's 2 ranks do.
                nodes.append("+launcher.env.OMP_NUM_THREADS=1")
                procs = [
                    on_host(host, [*nodes, f"launcher.node_rank={n}", f"hydra.run.dir={run_dir}"])
                    for n, host in reversed(list(enumerate(hosts)))
                ]
                two.append(finish(procs, run_dir))
                print(
                    f"repeat {i + 1}/{args.repeats}: one host {one[-1]['step_time_s'] * 1e3:.3f} ms/step, "
                    f"two hosts {two[-1]['step_time_s'] * 1e3:.3f} ms/step",
                    flush=True,
                )
    finally:
        if "already running" not in started.stderr:
            subprocess.run(["bash", str(HOSTS), "stop"], capture_output=True)
    ratios = sorted(t["step_time_s"] / o["step_time_s"] for o, t in zip(one, two, strict=True))
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    print()
    print(
        f"median step time: one host (2 ranks) {statistics.median(o['step_time_s'] for o in one) * 1e3:.3f} ms, "
        f"two hosts (1 rank each) {statistics.median(t['step_time_s'] for t in two) * 1e3:.3f} ms"
    )
    print(
        f"ratio two hosts / one host: median {statistics.median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f})   "
        f"[{args.repeats} alternating repeats, {args.epochs} epochs each; same final loss: "
        f"{one[-1]['final_train_loss'] == two[-1]['final_train_loss']}]"
    )


if __name__ == "__main__":
    main()
