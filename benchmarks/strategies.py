"""Step time and per-rank model-state memory of every strategy on one model, beside the ZeRO
paper's prediction, in one run.

    .venv/bin/python benchmarks/strategies.py [--repeats 3] [--steps 60]

Model: deep_mlp (equal 256-wide blocks, ~0.53 M parameters), fp32 Adam, the scalar field,
per-rank batch 32. Memory is `model_state_bytes` from summary.json (parameters + gradients +
optimizer state actually held by each rank), relative to DDP at the same world size.
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
    "data.dataset.num_points=6000",
    "data.dataset.num_test=200",
]
# (label, world size, overrides, ZeRO prediction of per-rank bytes relative to DDP)
CASES = [
    ("ddp", 2, ["strategy=ddp"], lambda n: 1.0),
    ("zero stage 1", 2, ["strategy=zero", "strategy.stage=1"], lambda n: (8 + 8 / n) / 16),
    ("zero stage 2", 2, ["strategy=zero", "strategy.stage=2"], lambda n: (4 + 12 / n) / 16),
    ("zero stage 3", 2, ["strategy=zero", "strategy.stage=3"], lambda n: 1 / n),
    ("fsdp", 2, ["strategy=fsdp"], lambda n: 1 / n),
    ("ddp", 4, ["strategy=ddp"], lambda n: 1.0),
    ("mics (groups of 2)", 4, ["strategy=mics", "strategy.partition_group_size=2"], lambda n: 1 / 2),
    ("fsdp", 4, ["strategy=fsdp"], lambda n: 1 / n),
]


def run(tmp: Path, tag: str, world: int, overrides: list[str], steps: int) -> dict:
    return dtf_summary(tmp / tag, [*COMMON, *overrides, f"launcher.nproc={world}", f"trainer.max_steps={steps}"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    results: dict[int, list[dict]] = {i: [] for i in range(len(CASES))}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.repeats):  # round-robin, so machine load hits every strategy alike
            for i, (_label, world, overrides, _) in enumerate(CASES):
                results[i].append(run(Path(d), f"{i}-{r}", world, overrides, args.steps))
            print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    ddp_bytes = {
        world: max(results[i][0]["model_state_bytes"]) for i, (lbl, world, _, _) in enumerate(CASES) if lbl == "ddp"
    }
    ddp_step = {
        world: statistics.median(s["step_time_s"] for s in results[i])
        for i, (lbl, world, _, _) in enumerate(CASES)
        if lbl == "ddp"
    }
    print()
    print(
        f"{'strategy':<20}{'ranks':>6}{'step ms':>10}{'x ddp':>8}{'MB/rank (max)':>15}{'x ddp':>8}"
        f"{'ZeRO formula':>14}{'final loss':>12}"
    )
    for i, (label, world, _, formula) in enumerate(CASES):
        step = statistics.median(s["step_time_s"] for s in results[i])
        most = max(results[i][0]["model_state_bytes"])
        print(
            f"{label:<20}{world:>6}{step * 1e3:>10.2f}{step / ddp_step[world]:>8.2f}{most / 2**20:>15.3f}"
            f"{most / ddp_bytes[world]:>8.3f}{formula(world):>14.3f}{results[i][0]['final_train_loss']:>12.5f}"
        )
    print(
        f"\nmedian of {args.repeats} repeats, {args.steps} optimizer steps each; ZeRO-2's formula is an upper "
        "bound: FSDP2 also keeps parameters sharded between steps, so stage 2 measures 1/N."
    )


if __name__ == "__main__":
    main()
