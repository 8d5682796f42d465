"""dtf's per-step overhead against a plain hand-written PyTorch DDP loop, measured in one run.

    .venv/bin/python benchmarks/overhead.py [--repeats 5] [--epochs 40] [--nproc 2]

Both train the default job (scalar-field MLP, Adam, per-rank batch 32, linear LR scaling,
gloo on CPU) with the same seed, alternating raw, dtf, raw, dtf, ... so that machine load
hits both alike. Each run reports its median optimizer-step wall time (warm-up excluded) and
its training time per step (the mean: what throughput sees; evaluation and checkpoint saves
excluded on both sides). The verdict is the median over repeats of each pair's ratio dtf / raw
(target: <= 1.05), with the quartiles of those ratios: on a shared 2-core machine single runs of
the same program scatter by 20% or more, so a ratio means something only next to its spread and
over many pairs. The step times of 2 ranks on 2 cores are not one bell: most steps take about the
same, a long tail of steps waits for the peer, and the median can jump between runs; the mean
ratio is the steadier of the two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import dtf_summary

HERE = Path(__file__).resolve().parent


def run_raw(tmp: Path, i: int, args: argparse.Namespace) -> dict:
    out = tmp / f"raw{i}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        str(HERE / "raw_ddp.py"),
        f"--epochs={args.epochs}",
        f"--out={out}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the raw loop failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_dtf(tmp: Path, i: int, args: argparse.Namespace) -> dict:
    overrides = [f"launcher.nproc={args.nproc}", f"trainer.max_epochs={args.epochs}", "trainer.progress=off"]
    return dtf_summary(tmp / f"dtf{i}", overrides)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=int, default=40, help="40 = the default job's trainer.max_epochs")
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    raw, ours = [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i in range(args.repeats):
            raw.append(run_raw(tmp, i, args))
            ours.append(run_dtf(tmp, i, args))
            print(
                f"repeat {i + 1}/{args.repeats}: raw {raw[-1]['step_time_s'] * 1e3:.3f} ms/step, "
                f"dtf {ours[-1]['step_time_s'] * 1e3:.3f} ms/step",
                flush=True,
            )
    raw_med = statistics.median(r["step_time_s"] for r in raw)
    dtf_med = statistics.median(r["step_time_s"] for r in ours)
    ratios = sorted(o["step_time_s"] / r["step_time_s"] for r, o in zip(raw, ours, strict=True))
    mean_ratios = sorted(
        (o["train_seconds"] / o["global_step"]) / (r["train_seconds"] / r["num_steps"])
        for r, o in zip(raw, ours, strict=True)
    )
    print()
    print(f"{'':24}{'raw DDP loop':>14}{'dtf':>14}")
    print(f"{'median step time (ms)':24}{raw_med * 1e3:>14.3f}{dtf_med * 1e3:>14.3f}")
    print(f"{'final train loss':24}{raw[-1]['final_train_loss']:>14.6g}{ours[-1]['final_train_loss']:>14.6g}")
    print(f"paired ratios dtf / raw: {' '.join(f'{r:.3f}' for r in ratios)}")
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    print(
        f"ratio dtf / raw: median {statistics.median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f}), "
        f"ratio of medians {dtf_med / raw_med:.3f}   "
        f"[{args.repeats} alternating repeats, {args.nproc} ranks, {args.epochs} epochs each]"
    )
    m1, _, m3 = statistics.quantiles(mean_ratios, n=4) if len(mean_ratios) > 1 else (mean_ratios[0],) * 3
    print(
        f"ratio of training time per step (mean) dtf / raw: median {statistics.median(mean_ratios):.3f} "
        f"(quartiles {m1:.3f}-{m3:.3f})"
    )


if __name__ == "__main__":
    main()
