"""Choosing on the validation split, in process on one rank: the objective defaults to val/loss and
is checked against the exported weights on the held-out samples (computed here with torch alone);
the test split is evaluated once, at the end; evaluations within an epoch land on the steps asked
for; early stopping stops at a step known in advance and survives a resume; checkpoint.keep_best
keeps the best checkpoint and best_model.pt holds its weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import instantiate

from dtf.errors import UserError
from tests.helpers.inprocess import compose_config, train_in_process

# 2,400 points, 400 of them test: 2,000 for training, of which 400 held out for validation,
# 1,600 left: 50 batches of 32 per epoch on one rank.
SMALL = [
    "data.dataset.num_points=2400",
    "data.dataset.num_test=400",
    "checkpoint.every_n_steps=null",
    "checkpoint.keep_last=1",
]
WITH_VAL = [*SMALL, "data.val_fraction=0.2", "data.val_seed=7"]
STEPS_PER_EPOCH = 50


def _run(tmp_path: Path, name: str, *args: str, stop: Any = None) -> dict[str, Any]:
    summary = train_in_process([*WITH_VAL, *args], tmp_path / name, stop)
    assert isinstance(summary, dict), summary
    return summary


def _val_loss_of(weights: Path, overrides: list[str]) -> float:
    """The mean MSE of the weights over the validation samples, which are picked here from the
    data set itself (a seeded permutation of the training samples, as data.val_fraction documents)."""
    cfg = compose_config(overrides)
    train, _ = instantiate(cfg.data.dataset)
    n = len(train)
    held = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.data.val_seed))[: round(0.2 * n)]
    model = instantiate(cfg.model)
    model.load_state_dict(torch.load(weights, weights_only=True))
    x = torch.stack([train[int(i)][0] for i in held])
    y = torch.stack([torch.as_tensor(train[int(i)][1]) for i in held])
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x).reshape(y.shape), y.to(torch.get_default_dtype())))


@pytest.fixture(scope="module")
def chosen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Three epochs, evaluated every half epoch, the best checkpoint kept."""
    tmp = tmp_path_factory.mktemp("chosen")  # checkpoint.keep_last=1 (SMALL saves only at the end)
    args = ["trainer.max_epochs=3", "trainer.eval_every_n_epochs=0.5", "checkpoint.keep_best=1"]
    return tmp / "run", _run(tmp, "run", *args)


Chosen = tuple[Path, dict[str, Any]]


def test_the_objective_defaults_to_the_validation_loss_of_the_final_weights(chosen: Chosen) -> None:
    run_dir, s = chosen
    assert s["objective_name"] == "val/loss"
    assert s["objective"] == s["final_val_loss"] == s["evaluations"][-1]["val/loss"]
    assert s["objective"] == pytest.approx(_val_loss_of(run_dir / "model.pt", WITH_VAL), rel=1e-5)


def test_the_test_split_is_evaluated_once_at_the_end(chosen: Chosen) -> None:
    _, s = chosen
    assert all(not any(k.startswith("test/") for k in e) for e in s["evaluations"])
    with_test = [m["epoch"] for m in s["metrics_per_epoch"] if "test/loss" in m]
    assert with_test == [3] and s["test_loss_per_epoch"] == [s["final_test_loss"]]
    assert s["final_metrics"]["test/loss"] == s["final_test_loss"] and "test/rmse" in s["final_metrics"]


def test_half_epoch_evaluations_land_on_their_steps(chosen: Chosen) -> None:
    _, s = chosen
    half = STEPS_PER_EPOCH // 2
    assert [e["step"] for e in s["evaluations"]] == [half * k for k in range(1, 7)]
    assert [e["epoch"] for e in s["evaluations"]] == [0.5, 1, 1.5, 2, 2.5, 3]


def test_the_best_checkpoint_and_best_model_hold_the_best_evaluation(chosen: Chosen) -> None:
    run_dir, s = chosen
    losses = {e["step"]: e["val/loss"] for e in s["evaluations"]}
    best_step = min(losses, key=lambda k: losses[k])
    assert (s["best_step"], s["best_objective"]) == (best_step, losses[best_step])
    assert s["best_objective"] == pytest.approx(_val_loss_of(run_dir / "best_model.pt", WITH_VAL), rel=1e-5)
    listed = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert listed["best"] == [{"step": best_step, "val/loss": losses[best_step], "path": f"step_{best_step:09d}"}]
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert kept == sorted({f"step_{best_step:09d}", f"step_{3 * STEPS_PER_EPOCH:09d}"})  # keep_best 1 + keep_last 1


def test_evaluations_every_n_steps_come_with_the_epoch_ends(tmp_path: Path) -> None:
    s = _run(tmp_path, "run", "trainer.max_epochs=2", "trainer.eval_every_n_steps=20")
    assert [e["step"] for e in s["evaluations"]] == [20, 40, 50, 60, 80, 100]


def test_a_fraction_of_an_odd_epoch_evaluates_as_often_as_it_says(tmp_path: Path) -> None:
    from dtf.config.schema import TrainerConfig

    # Lightning's val_check_interval=0.5 on 81 batches validates twice: so does dtf (after 40, and at the end)
    assert TrainerConfig(eval_every_n_epochs=0.5).eval_points_in_epoch(81) == {40}
    assert TrainerConfig(eval_every_n_epochs=0.25).eval_points_in_epoch(81) == {20, 40, 61}
    assert TrainerConfig(eval_every_n_epochs=0.3).eval_points_in_epoch(10) == {3, 6, 9}
    s = _run(tmp_path, "run", "trainer.max_epochs=2", "trainer.eval_every_n_epochs=0.5", "data.batch_size=33")
    per_epoch = s["global_step"] // 2
    assert per_epoch % 2 == 1, per_epoch  # odd: half an epoch is no whole step
    half = round(per_epoch / 2)
    assert [e["step"] for e in s["evaluations"]] == [half, per_epoch, per_epoch + half, 2 * per_epoch]


def test_early_stopping_stops_at_the_known_step_and_a_rerun_finds_it_finished(tmp_path: Path) -> None:
    # No evaluation after the first beats it by 1e9: with patience 2 the third evaluation stops the run.
    args = ["trainer.max_epochs=10", "trainer.early_stopping.patience=2", "trainer.early_stopping.min_delta=1e9"]
    s = _run(tmp_path, "run", *args)
    assert s["global_step"] == 3 * STEPS_PER_EPOCH and s["epochs"] == 3
    assert s["stopped_early"].startswith("early stopping: val/loss did not improve by more than 1e+09 in 2 evaluation")
    assert s["test_loss_per_epoch"] == [s["final_test_loss"]]  # the test split at the end, as any run's
    written = (tmp_path / "run" / "summary.json").read_bytes()
    assert _run(tmp_path, "run", *args) == s and (tmp_path / "run" / "summary.json").read_bytes() == written


def test_early_stopping_within_an_epoch_survives_a_resume_exactly(tmp_path: Path) -> None:
    args = [
        "trainer.max_epochs=10",
        "trainer.eval_every_n_steps=15",
        "trainer.early_stopping.patience=3",
        "trainer.early_stopping.min_delta=0.002",
    ]
    straight = _run(tmp_path, "straight", *args)
    assert straight["stopped_early"] and straight["global_step"] % 15 == 0  # stopped at an evaluation within an epoch
    stop_at = straight["global_step"] - 25  # between two evaluations, after the best one
    _run(tmp_path, "resumed", *args, f"trainer.max_steps={stop_at}")
    resumed = _run(tmp_path, "resumed", *args)
    assert resumed["resumed_from_step"] == stop_at
    for key in ("global_step", "params_sha256", "evaluations", "best_step", "best_objective", "stopped_early"):
        assert resumed[key] == straight[key], key


def test_choosing_on_the_test_set_is_warned_about_or_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = train_in_process([*SMALL, "trainer.max_steps=2"], tmp_path / "no_val")
    assert s["objective_name"] == "test/loss" and s["evaluations"][-1]["test/loss"] == s["final_test_loss"]
    assert "selecting on the test set" not in capsys.readouterr().out  # nothing chooses by it
    train_in_process([*SMALL, "trainer.max_steps=2", "trainer.early_stopping.patience=1"], tmp_path / "chooses")
    assert (
        "warning: trainer.objective=test/loss chooses (trainer.early_stopping): selecting on the test set biases its "
        "score upward" in capsys.readouterr().out
    )
    with pytest.raises(UserError, match=r"^trainer.objective=test/loss: with a validation split .* judge by val/loss$"):
        _run(tmp_path, "refused", "trainer.objective=test/loss", "trainer.max_steps=2")
    with pytest.raises(UserError, match=r"^trainer.objective=val/rmse: this data has no validation split"):
        train_in_process([*SMALL, "trainer.objective=val/rmse", "trainer.max_steps=2"], tmp_path / "no_val2")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.eval_every_n_epochs=1.5", "trainer.eval_every_n_epochs=1.5 is invalid: use a whole number"),
        ("trainer.eval_every_n_steps=0", "trainer.eval_every_n_steps=0 is invalid"),
        ("trainer.early_stopping.patience=0", "trainer.early_stopping.patience=0 is invalid"),
        ("checkpoint.keep_best=-1", "checkpoint.keep_best=-1 is invalid"),
    ],
)
def test_bad_selection_settings_are_one_line_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        from dtf.cli import freeze

        freeze(compose_config([override]))


def test_dtf_eval_of_the_best_checkpoint_gives_its_reported_objective(chosen: Chosen) -> None:
    from dtf.config.typed import typed
    from dtf.train import evaluate as evaluation
    from tests.helpers.inprocess import group_of_one

    run_dir, s = chosen
    best = run_dir / "checkpoints" / f"step_{s['best_step']:09d}"
    cfg = compose_config([*WITH_VAL, "trainer.max_epochs=3"])
    with group_of_one() as env:
        result = evaluation.run(typed(cfg), env, run_dir / "evaluations", evaluation.EvalRequest(str(best), ("val",)))
    assert result is not None and result.summary["metrics"]["val/loss"] == s["best_objective"]  # same rank, same order
    assert json.loads((best / "eval.json").read_text())["metrics"] == result.summary["metrics"]


def test_evaluations_every_n_steps_also_land_on_epoch_ends_that_do_not_evaluate(tmp_path: Path) -> None:
    s = _run(tmp_path, "run", "trainer.max_epochs=3", "trainer.eval_every_n_steps=25", "trainer.eval_every_n_epochs=2")
    assert [e["step"] for e in s["evaluations"]] == [25, 50, 75, 100, 125, 150]


def test_selection_settings_that_would_do_nothing_are_refused(tmp_path: Path) -> None:
    from dtf.cli import freeze

    with pytest.raises(UserError, match=r"^trainer\.early_stopping\.min_delta=0\.1 is invalid: .*patience"):
        freeze(compose_config(["trainer.early_stopping.min_delta=0.1"]))
    no_eval = [
        "data.dataset._target_=tests.unit.test_selection.train_only",
        *(f"~data.dataset.{k}" for k in ("num_points", "num_test", "low", "high", "seed")),
        "trainer.max_steps=2",
    ]
    for override in ("trainer.eval_every_n_steps=5", "trainer.eval_every_n_epochs=0.5"):
        with pytest.raises(UserError, match=r"^trainer\.eval_every_n_.* this data has no validation or test split"):
            train_in_process([*no_eval, override], tmp_path / override)


def train_only() -> Any:
    """A data.dataset builder that gives a training set alone (no validation, no test split)."""
    from dtf.data.datasets import scalar_field

    return scalar_field(num_points=1200, num_test=200)[0]
