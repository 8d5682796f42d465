"""trainer.precision, trainer.activation_checkpointing and trainer.compile, in process on one rank:
what each really does inside the model, the fp16 scaler across an overflow and a resume, and
resumes with each switch on (or switched at the resume). The same switches on 2 ranks and every
strategy: tests/dist/test_precision.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from dtf.config.schema import DDPStrategyConfig, FSDPStrategyConfig
from dtf.models.approximator import Approximator
from dtf.strategy.ddp import DDPStrategy
from dtf.strategy.fsdp import FSDPStrategy
from dtf.train.blocks import checkpoint_activations, compile_model
from tests.helpers.inprocess import train_in_process

# As the runs import it (model._target_=probe.ProbeMLP): the same module, the same counters.
from probe import ProbeLinear  # isort: skip

# 2,000 training samples: 63 steps of 32 per epoch on one rank; plain SGD (a calm run, where
# rounding differences stay small; momentum 0.9 at this LR amplifies them to ~5% in two epochs).
SGD = [
    "optimizer=sgd",
    "optimizer.lr=0.01",
    "trainer.max_epochs=2",
    "data.dataset.num_points=2400",
    "data.dataset.num_test=400",
    "checkpoint.every_n_steps=null",
]
# 640 training samples: 20 steps per epoch, 40 in all; a run stopped at 25 is in the middle of epoch 2.
SHORT = [
    "optimizer=sgd",
    "optimizer.lr=0.05",
    "optimizer.momentum=0.9",
    "trainer.max_epochs=2",
    "data.dataset.num_points=800",
    "data.dataset.num_test=160",
    "checkpoint.every_n_steps=null",
]
PROBE = ["model._target_=probe.ProbeMLP"]
OUTLIER_STEP = 10  # unshuffled, one rank, batches of 32: sample 293 is in batch 9, trained in step 10


def _outliers(*samples: int) -> list[str]:
    """The scalar field, unshuffled, with these training samples' targets made to overflow fp16."""
    return [
        "data.dataset._target_=probe.scalar_field_with_outliers",
        f"+data.dataset.outliers={list(samples)}",
        "~data.dataset.low",
        "~data.dataset.high",
        "~data.dataset.seed",
        "data.shuffle=false",
    ]


def _run(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    summary = train_in_process(list(args), tmp_path / name)
    assert summary is not None
    return summary


def _curve(s: dict[str, Any]) -> list[float]:
    return [*s["train_loss_per_epoch"], *s["test_loss_per_epoch"]]


def _weights(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / name / "model.pt", weights_only=True)


def _final_trainer_state(tmp_path: Path, name: str) -> dict[str, Any]:
    newest = sorted((tmp_path / name / "checkpoints").glob("step_*"))[-1]
    return torch.load(newest / "trainer.pt", weights_only=True)


# -- precision --------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_follows_the_fp32_curve_within_1_percent_but_not_bit_for_bit(
    tmp_path: Path, precision: str
) -> None:
    fp32 = _run(tmp_path, "fp32", *SGD)
    mixed = _run(tmp_path, "mixed", *SGD, f"trainer.precision={precision}")
    assert _curve(mixed) == pytest.approx(_curve(fp32), rel=1e-2)  # measured: within 0.08%
    assert mixed["params_sha256"] != fp32["params_sha256"]  # autocast ran: not the fp32 numbers
    ours, theirs = _weights(tmp_path, "mixed"), _weights(tmp_path, "fp32")
    assert all(w.dtype == torch.float32 for w in ours.values())  # parameters (and optimizer) stay fp32
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) > 1e-5
    assert mixed["model_state_bytes"] == fp32["model_state_bytes"]


def test_bf16_true_trains_bf16_parameters_in_half_the_bytes(tmp_path: Path) -> None:
    fp32 = _run(tmp_path, "fp32", *SGD)
    true = _run(tmp_path, "true", *SGD, "trainer.precision=bf16-true")
    assert all(w.dtype == torch.bfloat16 for w in _weights(tmp_path, "true").values())
    # parameters, gradients and momentum: 2 bytes each instead of 4
    assert true["model_state_bytes"] == [b // 2 for b in fp32["model_state_bytes"]]
    assert _curve(true) == pytest.approx(_curve(fp32), rel=0.1)  # bf16 updates: measured within 2.8%


@pytest.mark.parametrize(
    ("strategy", "precision", "seen"),
    [
        ("ddp", "32", torch.float32),
        ("ddp", "bf16-mixed", torch.float32),  # autocast casts inside each op; the weight stays fp32
        ("fsdp", "bf16-mixed", torch.bfloat16),  # FSDP gathers it in bf16 (MixedPrecisionPolicy)
        ("fsdp", "fp16-mixed", torch.float16),
        ("fsdp", "32", torch.float32),
        ("zero", "bf16-true", torch.bfloat16),  # the parameter itself
    ],
)
def test_the_weights_a_forward_sees(tmp_path: Path, strategy: str, precision: str, seen: torch.dtype) -> None:
    ProbeLinear.reset()
    _run(
        tmp_path, "run", *PROBE, *SHORT, f"strategy={strategy}", f"trainer.precision={precision}", "trainer.max_steps=2"
    )
    assert ProbeLinear.weight_dtypes == {seen}


def test_the_strategies_set_fsdps_policy_and_their_scaler_from_the_one_switch() -> None:
    fsdp = OmegaConf.structured(FSDPStrategyConfig())
    for precision, param, reduce in [
        ("32", None, None),
        ("bf16-mixed", torch.bfloat16, torch.float32),
        ("fp16-mixed", torch.float16, torch.float32),
        ("bf16-true", None, None),
    ]:
        policy = FSDPStrategy(fsdp, precision).mixed_precision()
        assert (policy.param_dtype, policy.reduce_dtype) == (param, reduce), precision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    cpu = torch.device("cpu")
    assert isinstance(FSDPStrategy(fsdp, "fp16-mixed").grad_scaler(cpu), ShardedGradScaler)
    assert not isinstance(DDPStrategy(OmegaConf.structured(DDPStrategyConfig())).grad_scaler(cpu), ShardedGradScaler)


# -- fp16: the scaler --------------------------------------------------------------------------
def test_an_overflowing_fp16_step_is_skipped_and_changes_nothing_else(tmp_path: Path) -> None:
    data = [*SGD, *_outliers(293)]
    before = _run(tmp_path, "before", *data, "trainer.precision=fp16-mixed", f"trainer.max_steps={OUTLIER_STEP - 1}")
    at = _run(tmp_path, "at", *data, "trainer.precision=fp16-mixed", f"trainer.max_steps={OUTLIER_STEP}")
    # (the first steps may overflow too: the scaler starts at 2^16 and backs off to what fits)
    assert at["skipped_steps"] == before["skipped_steps"] + 1
    assert at["params_sha256"] == before["params_sha256"]  # the skipped step left the weights as they were
    assert at["global_step"] == OUTLIER_STEP  # ... and still counts as a step
    scale = [_final_trainer_state(tmp_path, name)["precision"]["scaler"]["scale"] for name in ("before", "at")]
    assert scale[1] == scale[0] / 2  # backed off once more
    # The whole run: skipped once per epoch (the outlier comes back), and it learns as on clean data.
    whole = _run(tmp_path, "whole", *data, "trainer.precision=fp16-mixed")
    clean = _run(tmp_path, "clean", *SGD, *_outliers(), "trainer.precision=fp16-mixed")
    assert whole["skipped_steps"] - clean["skipped_steps"] == 2
    assert whole["test_loss_per_epoch"] == pytest.approx(clean["test_loss_per_epoch"], rel=0.02)  # measured: 0.5%
    # fp32 has no scaler to skip the step: the outlier's gradient throws the model off (trained on
    # here; by default a non-finite loss would stop the run, trainer.on_nonfinite)
    fp32 = _run(tmp_path, "fp32", *data, "trainer.on_nonfinite=ignore")
    assert fp32["skipped_steps"] is None and not fp32["final_test_loss"] < 2 * whole["final_test_loss"]  # (or NaN)


def test_the_fp16_scaler_state_survives_a_resume(tmp_path: Path) -> None:
    data = [*SGD, *_outliers(293), "trainer.precision=fp16-mixed"]
    straight = _run(tmp_path, "straight", *data)
    _run(tmp_path, "resumed", *data, "trainer.max_steps=40")  # after the first skip (step 10)
    resumed = _run(tmp_path, "resumed", *data)
    assert resumed["resumed_from_step"] == 40
    assert resumed["params_sha256"] == straight["params_sha256"]
    assert resumed["skipped_steps"] == straight["skipped_steps"] >= 2
    # A fresh scaler at step 40 would end with another scale and growth tracker.
    ours, theirs = (_final_trainer_state(tmp_path, name)["precision"] for name in ("resumed", "straight"))
    assert ours == theirs and ours["scaler"]["scale"] < 2.0**16


# -- activation checkpointing and compile ------------------------------------------------------
def test_activation_checkpointing_recomputes_every_block_and_changes_no_bit(tmp_path: Path) -> None:
    ProbeLinear.reset()
    plain = _run(tmp_path, "plain", *PROBE, *SHORT)
    plain_calls = ProbeLinear.calls
    ProbeLinear.reset()
    ac = _run(tmp_path, "ac", *PROBE, *SHORT, "trainer.activation_checkpointing=[ProbeLinear]")
    # each of the 3 blocks runs once more per training step: its recomputation in backward
    assert ProbeLinear.calls - plain_calls == 3 * plain["global_step"]
    assert ac["params_sha256"] == plain["params_sha256"] and _curve(ac) == _curve(plain)


def test_the_switches_keep_parameter_names_and_state_dict_keys() -> None:
    model = Approximator()
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    assert len(checkpoint_activations(model, ["Linear"], None)) == 3
    assert len(compile_model(model, "blocks", None)) == 3
    assert len(compile_model(model, True, None)) == 1
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys


SWITCHES = {
    "bf16-mixed": ["trainer.precision=bf16-mixed"],
    "bf16-true": ["trainer.precision=bf16-true"],
    "ac": ["trainer.activation_checkpointing=[Linear]"],
    "compile": ["trainer.compile=true"],
    "compile-blocks": ["trainer.compile=blocks"],
}


@pytest.mark.parametrize(
    ("strategy", "switch"),
    # (fsdp with bf16-mixed, blocks compiled and checkpointed at once: tests/dist/test_precision.py)
    [("ddp", s) for s in SWITCHES] + [("fsdp", s) for s in ("bf16-true", "compile")],
)
def test_a_resume_with_the_switch_on_is_bit_for_bit(tmp_path: Path, strategy: str, switch: str) -> None:
    args = [*SHORT, f"strategy={strategy}", *SWITCHES[switch]]
    straight = _run(tmp_path, "straight", *args)
    _run(tmp_path, "resumed", *args, "trainer.max_steps=25")
    resumed = _run(tmp_path, "resumed", *args)
    assert resumed["resumed_from_step"] == 25
    assert resumed["params_sha256"] == straight["params_sha256"] and _curve(resumed) == _curve(straight)
    if "compile" in switch:
        assert resumed["compiled_graphs"] >= 1


@pytest.mark.parametrize(
    ("before", "after", "bit_for_bit"),
    [
        ([], ["trainer.compile=true"], False),
        (["trainer.compile=true"], [], False),
        ([], ["trainer.activation_checkpointing=[Linear]"], True),
        (["trainer.activation_checkpointing=[Linear]"], [], True),
        ([], ["trainer.precision=fp16-mixed"], None),  # a checkpoint without scaler state: a fresh scaler
    ],
)
def test_a_checkpoint_resumes_with_a_switch_turned_on_or_off(
    tmp_path: Path, before: list[str], after: list[str], bit_for_bit: bool | None
) -> None:
    straight = _run(tmp_path, "straight", *SHORT, *after)
    _run(tmp_path, "resumed", *SHORT, *before, "trainer.max_steps=25")
    resumed = _run(tmp_path, "resumed", *SHORT, *after)
    assert resumed["resumed_from_step"] == 25  # the names matched: everything loaded
    if bit_for_bit:
        assert resumed["params_sha256"] == straight["params_sha256"]
    elif bit_for_bit is False:  # compiled and eager steps agree to rounding
        ours, theirs = _weights(tmp_path, "resumed"), _weights(tmp_path, "straight")
        assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5
    else:
        assert resumed["global_step"] == straight["global_step"] and resumed["skipped_steps"] is not None
        assert all(0 < loss < 2 for loss in _curve(resumed))
