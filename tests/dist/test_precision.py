"""Same switch, same result: trainer.precision, trainer.compile and trainer.activation_checkpointing
on 2 ranks, on every strategy they change something for. SGD with momentum throughout, so that a
gradient-scale error cannot hide (Adam would normalise it away).

The runs go through the ranks' own body (dtf.train.loop.run) on 2 gloo ranks started once
(tests.helpers.inprocess.train_on_ranks): ~1 s a run instead of ~9 s through `python -m dtf`.
One run at the end goes through the command line, for the launcher path and the log line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.inprocess import train_on_ranks
from tests.helpers.run_command import run_dtf

# 512 training samples: 8 steps of 2 x 32 per epoch, no short batch (one compiled shape); 4 epochs.
SGD = [
    "optimizer=sgd",
    "optimizer.lr=0.01",
    "optimizer.momentum=0.9",
    "trainer.max_epochs=4",
    "data.dataset.num_points=640",
    "data.dataset.num_test=128",
    "checkpoint.every_n_steps=null",
]
STRATEGIES = {
    "ddp": ["strategy=ddp"],
    "zero1": ["strategy=zero", "strategy.stage=1"],
    "zero3": ["strategy=zero", "strategy.stage=3"],
    "fsdp": ["strategy=fsdp"],
    "mics": ["strategy=mics", "strategy.partition_group_size=2"],
}
COMPILED = [(s, m) for s in ("ddp", "fsdp") for m in ("true", "blocks")]
# fp16 on data whose batch 3 (samples 96-127 of rank 0, unshuffled) overflows fp16 gradients
OUTLIERS = [
    "data.dataset._target_=probe.scalar_field_with_outliers",
    "+data.dataset.outliers=[100]",
    "~data.dataset.low",
    "~data.dataset.high",
    "~data.dataset.seed",
    "data.shuffle=false",
]
ALL_ON = ["trainer.precision=bf16-mixed", "trainer.compile=blocks", "trainer.activation_checkpointing=[Linear]"]

RUNS: list[tuple[str, list[str]]] = [
    ("ddp-32", [*SGD, *STRATEGIES["ddp"]]),
    ("fsdp-32", [*SGD, *STRATEGIES["fsdp"]]),
    *[(f"{name}-bf16", [*SGD, *args, "trainer.precision=bf16-mixed"]) for name, args in STRATEGIES.items()],
    *[(f"{s}-ac", [*SGD, *STRATEGIES[s], "trainer.activation_checkpointing=[Linear]"]) for s in ("ddp", "fsdp")],
    *[(f"{s}-compile-{m}", [*SGD, *STRATEGIES[s], f"trainer.compile={m}"]) for s, m in COMPILED],
    *[(f"{s}-fp16", [*SGD, *STRATEGIES[s], *OUTLIERS, "trainer.precision=fp16-mixed"]) for s in ("ddp", "fsdp")],
    # every switch at once, straight, and stopped at step 12 then resumed in the same run dir
    ("fsdp-all", [*SGD, *STRATEGIES["fsdp"], *ALL_ON]),
    ("fsdp-all-resumed", [*SGD, *STRATEGIES["fsdp"], *ALL_ON, "trainer.max_steps=12"]),
    ("fsdp-all-resumed", [*SGD, *STRATEGIES["fsdp"], *ALL_ON]),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("precision")
    summaries = train_on_ranks(2, RUNS, root)
    return {name: (summary, root / name) for name, summary in summaries.items()}


def _curve(summary: dict[str, Any]) -> list[float]:
    return [*summary["train_loss_per_epoch"], *summary["test_loss_per_epoch"]]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def _max_difference(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_bf16_mixed_trains_alike_on_every_strategy_and_close_to_fp32(runs: dict[str, Any], strategy: str) -> None:
    (bf16, bf16_dir), (ddp_bf16, ddp_bf16_dir) = runs[f"{strategy}-bf16"], runs["ddp-bf16"]
    fp32, fp32_dir = runs["ddp-32"]
    assert bf16["params_sha256_consistent"] and bf16["steps_per_rank"] == fp32["steps_per_rank"] == [32, 32]
    # Across strategies: within bf16's resolution (2^-8 of a value); measured here: the same bits.
    assert _curve(bf16) == pytest.approx(_curve(ddp_bf16), rel=1e-3)
    assert _max_difference(bf16_dir, ddp_bf16_dir) < 1e-3
    # Against fp32: the same training within 2% (measured: at most 0.35%) ...
    assert _curve(bf16) == pytest.approx(_curve(fp32), rel=2e-2)
    # ... but not the same numbers: autocast really ran (fp32 master weights differ by ~6e-3 here).
    assert bf16["params_sha256"] != fp32["params_sha256"]
    assert _max_difference(bf16_dir, fp32_dir) > 1e-4
    assert _weights(bf16_dir)["net.0.weight"].dtype == torch.float32  # the parameters stay fp32


@pytest.mark.parametrize(("strategy", "mode"), COMPILED)
def test_compiled_training_ends_within_1e_5_of_eager(runs: dict[str, Any], strategy: str, mode: str) -> None:
    (compiled, compiled_dir), (eager, eager_dir) = runs[f"{strategy}-compile-{mode}"], runs[f"{strategy}-32"]
    assert compiled["compiled_graphs"] >= 1, "nothing was compiled"  # else "equal to eager" proves nothing
    assert compiled["first_step_s"] > 0 and eager["compiled_graphs"] is None
    assert _max_difference(compiled_dir, eager_dir) < 1e-5  # measured: 6e-8
    assert _curve(compiled) == pytest.approx(_curve(eager), rel=1e-5)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_activation_checkpointing_changes_no_bit(runs: dict[str, Any], strategy: str) -> None:
    (ac, _), (plain, _) = runs[f"{strategy}-ac"], runs[f"{strategy}-32"]
    # (that the blocks really are recomputed is tests/unit/test_precision.py's to show)
    assert ac["params_sha256"] == plain["params_sha256"]
    assert ac["train_loss_per_epoch"] == plain["train_loss_per_epoch"]


def test_fp16_mixed_skips_the_same_steps_on_ddp_and_fsdp(runs: dict[str, Any]) -> None:
    (ddp, ddp_dir), (fsdp, fsdp_dir) = runs["ddp-fp16"], runs["fsdp-fp16"]
    # the outlier batch comes once per epoch; every rank skips it (FSDP's scaler all-reduces the overflow)
    assert ddp["skipped_steps"] == fsdp["skipped_steps"] >= 4
    assert fsdp["params_sha256_consistent"] and ddp["global_step"] == fsdp["global_step"] == 32
    assert _max_difference(fsdp_dir, ddp_dir) < 1e-3
    assert all(0 < loss < 1 for loss in fsdp["test_loss_per_epoch"])  # clean test data: still learning


def test_every_switch_at_once_resumes_bit_for_bit_on_fsdp(runs: dict[str, Any]) -> None:
    (straight, _), (resumed, _) = runs["fsdp-all"], runs["fsdp-all-resumed"]
    assert resumed["resumed_from_step"] == 12
    assert resumed["params_sha256"] == straight["params_sha256"]
    assert _curve(resumed) == _curve(straight)


def test_the_command_line_runs_the_switches_and_logs_the_first_step(tmp_path: Path) -> None:
    run = run_dtf([*SGD, "strategy=fsdp", *ALL_ON, "launcher.nproc=2", "trainer.max_epochs=1"], tmp_path / "run")
    line = next(line for line in run.stdout.splitlines() if line.startswith("dtf: first step"))
    assert "includes compilation" in line and "trainer.compile=blocks" in line
    s = run.summary
    assert s["compiled_graphs"] >= 1 and s["params_sha256_consistent"] and s["global_step"] == 8
    assert len(s["peak_rss_bytes"]) == 2 and all(b > 0 for b in s["peak_rss_bytes"])
