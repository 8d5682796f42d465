"""trainer.on_nonfinite on every path: DDP and ZeRO-1 (each rank holds the averaged gradients),
FSDP (each holds a shard: rank 1's shards of a 2 -> 1 linear model are empty, so it learns of a
NaN only from the others), gradient accumulation and fp16's scaler. A non-finite step that is
skipped changes what a step with zero gradients changes under plain SGD, nothing: the runs are
compared with that reference, bit for bit. A stop names the step on every rank and leaves no
checkpoint from it or after it.

The runs go through the ranks' own body (dtf.train.loop.run) on gloo ranks started once; the
command line's side (one line, exit status 1) is tests/e2e/test_checkpoint.py's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.gloo import run_on_ranks

BASE = [
    "model._target_=user_models.NonFiniteModel",
    "+model.at_call=5",
    "optimizer=sgd",
    "optimizer.lr=0.05",
    "data.dataset.num_points=2400",
    "data.dataset.num_test=400",
    "trainer.max_steps=8",
    "checkpoint.every_n_steps=2",
    "trainer.on_nonfinite=skip",
]
STRATEGIES = {
    "ddp": ["strategy=ddp"],
    "zero1": ["strategy=zero", "strategy.stage=1"],
    "fsdp": ["strategy=fsdp"],
}
# name: overrides; each strategy's runs are compared with its own reference
RUNS: dict[str, list[str]] = {}
for _s, _args in STRATEGIES.items():
    RUNS[f"{_s}_reference"] = [*BASE, *_args, "+model.how=zero_grad"]
    RUNS[f"{_s}_nan_grad"] = [*BASE, *_args, "+model.how=nan_grad", "+model.ranks=[1]"]
    RUNS[f"{_s}_inf_loss"] = [*BASE, *_args, "+model.how=inf_loss", "+model.ranks=[1]"]
    RUNS[f"{_s}_stop"] = [*BASE, *_args, "+model.how=nan_loss", "+model.ranks=[1]", "trainer.on_nonfinite=stop"]
ACCUM = [*BASE, "trainer.grad_accum_steps=2", "trainer.max_steps=4"]  # calls 5 and 6 make step 3
RUNS["accum_reference"] = [*ACCUM, "+model.how=zero_grad", "model.at_call=[5,6]"]
RUNS["accum_nan_loss"] = [*ACCUM, "+model.how=nan_loss", "+model.ranks=[0]"]
FP16 = [*BASE, "trainer.precision=fp16-mixed"]
RUNS["fp16_reference"] = [*FP16, "+model.how=zero_grad"]
RUNS["fp16_nan_loss"] = [*FP16, "+model.how=nan_loss", "+model.ranks=[1]"]
RUNS["fp16_stop"] = [*FP16, "+model.how=nan_loss", "+model.ranks=[1]", "trainer.on_nonfinite=stop"]
# finite gradients, and an update that overflows: the state is checked before the save of step 1
RUNS["state"] = [*BASE, "+model.at_call=[]", "optimizer.lr=inf", "checkpoint.every_n_steps=1"]


def _runs(rank: int, world_size: int, runs: dict[str, list[str]], root: Path) -> None:
    import torch

    from dtf.config.typed import typed
    from dtf.dist import env as dist_env
    from dtf.errors import TrainingFailed
    from dtf.train.loop import run
    from tests.helpers.inprocess import compose_config

    torch.set_num_threads(1)
    env = dist_env.init("cpu", "gloo", 60.0)
    for name, overrides in runs.items():
        cfg = compose_config([f"launcher.nproc={world_size}", *overrides])
        (root / name).mkdir(parents=True, exist_ok=True)
        try:
            run(typed(cfg), env, root / name)
        except TrainingFailed as e:
            (root / name / f"failed_{rank}.txt").write_text(str(e))


@dataclass
class Outcome:
    run_dir: Path

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def failed(self) -> list[str]:
        return [
            (self.run_dir / f"failed_{r}.txt").read_text()
            for r in (0, 1)
            if (self.run_dir / f"failed_{r}.txt").exists()
        ]

    @property
    def checkpoints(self) -> list[int]:
        from dtf.train.checkpoint import committed

        return sorted(int(p.name.removeprefix("step_")) for p in committed(self.run_dir / "checkpoints"))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    root = tmp_path_factory.mktemp("nonfinite")
    run_on_ranks(_runs, 2, RUNS, root)
    return {name: Outcome(root / name) for name in RUNS}


def _same_params(a: Outcome, b: Outcome) -> None:
    assert a.summary["params_sha256"] == b.summary["params_sha256"]
    assert a.summary["global_step"] == b.summary["global_step"]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("how", ["nan_grad", "inf_loss"])  # the gradients, or one rank's loss only
def test_a_skipped_step_changes_nothing_on_every_rank(outcomes: dict[str, Outcome], strategy: str, how: str) -> None:
    run, reference = outcomes[f"{strategy}_{how}"], outcomes[f"{strategy}_reference"]
    assert not run.failed and run.summary["nonfinite_steps_skipped"] == 1
    assert reference.summary["nonfinite_steps_skipped"] == 0
    _same_params(run, reference)
    assert run.summary["params_sha256_consistent"]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_stop_names_the_step_on_every_rank_and_commits_nothing_from_it(
    outcomes: dict[str, Outcome], strategy: str
) -> None:
    run = outcomes[f"{strategy}_stop"]
    assert len(run.failed) == 2 and run.failed[0] == run.failed[1], run.failed
    assert run.failed[0] == (
        "training diverged: the loss or its gradients are not finite (NaN or inf) at step 5 "
        "(trainer.on_nonfinite=stop); the run stopped there and its newest checkpoint, step_000000004, holds the last "
        "finite state: lower optimizer.lr, set trainer.grad_clip_norm, or leave such steps out with "
        "trainer.on_nonfinite=skip"
    )
    assert run.checkpoints == [2, 4]
    assert not (run.run_dir / "summary.json").exists() and not (run.run_dir / "model.pt").exists()


def test_one_non_finite_micro_batch_skips_its_whole_accumulation_window(outcomes: dict[str, Outcome]) -> None:
    run = outcomes["accum_nan_loss"]
    assert not run.failed and run.summary["nonfinite_steps_skipped"] == 1
    _same_params(run, outcomes["accum_reference"])


def test_under_fp16_a_non_finite_loss_is_skipped_or_stops(outcomes: dict[str, Outcome]) -> None:
    skipped = outcomes["fp16_nan_loss"]
    assert not skipped.failed and skipped.summary["nonfinite_steps_skipped"] == 1
    reference = outcomes["fp16_reference"]
    assert skipped.summary["skipped_steps"] == reference.summary["skipped_steps"]  # not one more overflow
    _same_params(skipped, reference)
    stopped = outcomes["fp16_stop"]
    assert len(stopped.failed) == 2 and "not finite (NaN or inf) at step 5" in stopped.failed[0]


def test_a_state_that_became_non_finite_is_never_checkpointed(outcomes: dict[str, Outcome]) -> None:
    run = outcomes["state"]  # on_nonfinite=skip: no skip mends a state that is not finite
    assert len(run.failed) == 2 and run.failed[0].startswith(
        "training diverged: the parameters or the optimizer state are not finite (NaN or inf) at step 1 "
    ), run.failed
    assert run.checkpoints == [] and not (run.run_dir / "checkpoints" / f"step_{1:09d}").exists()
