"""Step time and peak memory per rank of the performance switches (trainer.precision, compile,
activation_checkpointing) against fp32, side by side in one run.

    .venv/bin/python benchmarks/precision.py [--repeats 3] [--steps 30] [--nproc 2]

Two models on 2 DDP ranks (gloo): mnist_cnn on random 1x28x28 images (per-rank batch 512) and
deep_mlp on the scalar field (per-rank batch 4096), large batches so that activations weigh in
the memory. Each configuration is a `python -m dtf` run; the configurations alternate (round
robin) so that machine load hits them alike, and each figure is the median over repeats.

- step ms: median optimizer-step time (summary.json's step_time_s: the first steps, where
  compilation happens, left out); x fp32: its ratio to fp32's of the same repeat (median over
  repeats, and their range: on a shared machine the range says how far to trust it).
- first step s: the first step, compilation included (trainer.compile).
- peak RSS: the largest peak resident memory of any rank (summary.json's peak_rss_bytes: the whole
  process, libraries included); +MB: its difference to fp32's (activations, compiler, caches).
- state MB: parameters + gradients + optimizer state per rank (model_state_bytes).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch
from common import dtf_summary

MODELS = {
    "mnist_cnn": [
        "model=mnist_cnn",
        "data=fake_images",
        "loss=nll",
        "optimizer=sgd",
        "optimizer.lr=0.01",
        "data.batch_size=512",
        "data.dataset.num_test=1024",
    ],
    "deep_mlp": ["model=deep_mlp", "optimizer=sgd", "optimizer.lr=0.001", "data.batch_size=4096"],
}
# (label, overrides) per model; fp32 first (the reference of the ratios).
SWITCHES = {
    "mnist_cnn": [
        ("fp32", []),
        ("bf16-mixed", ["trainer.precision=bf16-mixed"]),
        ("compile", ["trainer.compile=true"]),
        ("ac [Conv2d,Linear]", ["trainer.activation_checkpointing=[Conv2d,Linear]"]),
    ],
    "deep_mlp": [
        ("fp32", []),
        ("bf16-mixed", ["trainer.precision=bf16-mixed"]),
        ("compile", ["trainer.compile=true"]),
        ("ac [Linear]", ["trainer.activation_checkpointing=[Linear]"]),  # each block: one Linear layer
        ("ac [Sequential]", ["trainer.activation_checkpointing=[Sequential]"]),  # the whole net as one block
    ],
}
COMMON = ["trainer.progress=off", "trainer.export_weights=false", "checkpoint.at_end=false",
          "checkpoint.every_n_steps=null", "trainer.tensorboard=false"]  # fmt: skip


def data_size(model: str, steps: int, nproc: int) -> list[str]:
    """Enough training samples for `steps` full steps in one epoch."""
    batch = int(next(a for a in MODELS[model] if a.startswith("data.batch_size=")).split("=")[1])
    train = batch * nproc * steps
    if model == "mnist_cnn":
        return [f"data.dataset.num_samples={train}"]
    return [f"data.dataset.num_points={train + 1024}", "data.dataset.num_test=1024"]


def run(tmp: Path, tag: str, model: str, overrides: list[str], args: argparse.Namespace) -> dict:
    return dtf_summary(
        tmp / tag,
        [
            *COMMON,
            *MODELS[model],
            *data_size(model, args.steps, args.nproc),
            *overrides,
            f"launcher.nproc={args.nproc}",
            f"trainer.max_steps={args.steps}",
        ],
    )


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor() or "?",
    )
    flags = Path("/proc/cpuinfo").read_text()
    extras = [f for f in ("avx512_bf16", "amx_bf16", "avx512_fp16") if f in flags]
    return (
        f"{cpu}, {os.cpu_count()} cores ({', '.join(extras) or 'no bf16 instructions'}), "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    cases = [(model, label, overrides) for model in MODELS for label, overrides in SWITCHES[model]]
    results: dict[int, list[dict]] = {i: [] for i in range(len(cases))}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.repeats):  # round robin, so machine load hits every configuration alike
            for i, (model, _, overrides) in enumerate(cases):
                results[i].append(run(Path(d), f"{i}-{r}", model, overrides, args))
            print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    print(f"\n{machine()}; {args.nproc} ranks (gloo), {args.steps} steps per run, median of {args.repeats} repeats\n")
    header = ["model", "switch", "step ms", "x fp32 (range)", "first step s", "peak RSS MB", "+MB", "state MB", "loss"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    reference: dict[str, int] = {}
    for i, (model, label, _) in enumerate(cases):
        reference.setdefault(model, i)  # fp32 comes first
        ref = results[reference[model]]
        step = statistics.median(s["step_time_s"] for s in results[i])
        ratios = [s["step_time_s"] / r["step_time_s"] for s, r in zip(results[i], ref, strict=True)]
        first = statistics.median(s["first_step_s"] for s in results[i])
        rss = statistics.median(max(s["peak_rss_bytes"]) for s in results[i]) / 2**20
        ref_rss = statistics.median(max(s["peak_rss_bytes"]) for s in ref) / 2**20
        state = max(results[i][0]["model_state_bytes"]) / 2**20
        loss = statistics.median(s["final_train_loss"] for s in results[i])
        print(
            f"| {model} | {label} | {step * 1e3:.1f} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {first:.2f} | {rss:.0f} | {rss - ref_rss:+.0f} | "
            f"{state:.2f} | {loss:.4f} |"
        )


if __name__ == "__main__":
    main()
