"""trainer=function and dtf.run_function, in this process on one rank: what the function may
return and how it is judged (the multi-rank behaviour: tests/dist/test_function_ranks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtf.data.datasets import scalar_field
from dtf.models.approximator import Approximator
from tests.helpers.inprocess import compose_config, function_in_process

SMALL = ["data.dataset.num_points=2000", "data.dataset.num_test=200"]


def test_the_objective_may_name_any_key_the_function_returns_with_no_loss_or_metrics_set(tmp_path: Path) -> None:
    accuracy = ["trainer.fn._target_=returned_values.accuracy", "trainer.objective=test/accuracy"]
    compose_config(["trainer=function", *accuracy, "trainer.objective_mode=max"])  # refused before: no such metric
    summary = function_in_process([*accuracy, "trainer.objective_mode=max", *SMALL], tmp_path / "run")
    # the value itself, computed here from the exported model over the whole test set
    model = Approximator()
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt"))
    x, y = scalar_field(num_points=2000, num_test=200)[1][:]
    with torch.no_grad():
        expected = ((model(x) - y).abs() < 1.0).float().mean().item()
    assert summary["objective_name"] == "test/accuracy" and summary["objective"] == pytest.approx(expected)
    assert summary["result"] == {"accuracy": summary["objective"]}


def test_run_function_runs_may_name_a_returned_key_too() -> None:
    from dtf.api import _function_config
    from dtf.cli import freeze

    cfg, _ = _function_config(["trainer.objective=test/accuracy", "trainer.objective_mode=max"], None)
    assert freeze(cfg).trainer.objective == "test/accuracy"  # refused before: no such metric


@pytest.mark.parametrize(
    ("override", "section", "what"),
    [
        ("optimizer.lr=0.5", "optimizer", "optimizer"),
        ("optimizer=sgd", "optimizer", "optimizer"),
        ("scheduler=cosine", "scheduler", "learning-rate schedule"),
        ("loss=nll", "loss", "loss"),
        ("metrics=mae", "metrics", "metrics"),
        ("~metrics.rmse", "metrics", "metrics"),
    ],
)
def test_a_section_the_function_never_reads_is_refused_not_ignored(override: str, section: str, what: str) -> None:
    from dtf.api import _function_config
    from dtf.cli import freeze
    from dtf.errors import UserError

    cfg, _ = _function_config([override], None)
    with pytest.raises(UserError) as err:
        freeze(cfg, [override])
    assert str(err.value) == (
        f"{override}: trainer=function does not use the {section} section (your function builds its own {what}): "
        "remove it; settings for your function go in trainer.hparams (+trainer.hparams.lr=0.01 reaches it as "
        "hparams['lr'])"
    )
    freeze(_function_config([], None)[0], ["trainer.hparams={lr: 0.5}", "model.hidden=8"])  # what it reads


@pytest.mark.parametrize(
    "override", ["trainer.max_steps=5", "trainer.grad_clip_norm=1.0", "trainer.early_stopping.patience=2"]
)
def test_a_trainer_key_only_the_loop_reads_is_refused_with_a_function(override: str) -> None:
    from dtf.api import _function_config
    from dtf.cli import freeze
    from dtf.errors import UserError

    cfg, _ = _function_config([override], None)
    with pytest.raises(UserError) as err:
        freeze(cfg, [override])
    key = ".".join(override.split("=")[0].split(".")[:2])
    assert str(err.value).startswith(f"{override}: trainer=function does not use {key} (the Trainer's loop reads it")
    seeded = _function_config(["trainer.seed=3"], None)[0]
    assert freeze(seeded, ["trainer.seed=3"]).trainer.seed == 3  # a key the function run reads


def test_a_mean_of_batch_means_is_averaged_as_returned_and_dtf_report_is_exact(tmp_path: Path) -> None:
    # 200 test points in batches of 64: 64, 64, 64, 8. The mean of the four batch means weighs
    # the last 8 points as much as 64; what dtf.report gets is the mean over the points.
    overrides = ["trainer.fn._target_=returned_values.mean_of_batch_means", "+trainer.hparams={eval_batch: 64}"]
    summary = function_in_process([*overrides, *SMALL], tmp_path / "run")
    model = Approximator()
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt"))
    x, y = scalar_field(num_points=2000, num_test=200)[1][:]
    with torch.no_grad():
        per_point = (model(x) - y).pow(2).squeeze(1).double()
    batch_means = [per_point[i : i + 64].mean().item() for i in range(0, 200, 64)]
    assert summary["result"]["exact_loss"] == pytest.approx(per_point.mean().item(), rel=1e-6)
    assert summary["result"]["loss"] == pytest.approx(sum(batch_means) / 4, rel=1e-6)
    assert abs(summary["result"]["loss"] - summary["result"]["exact_loss"]) > 1e-3  # they differ here
    assert summary["objective_name"] == "test/loss" and summary["objective"] == summary["result"]["loss"]


def test_dtf_report_outside_a_training_function_is_one_line() -> None:
    import dtf
    from dtf.errors import UserError

    with pytest.raises(UserError, match=r"dtf.report\(name, total, count\) is for a training function"):
        dtf.report("loss", 1.0, 2)


NUMBERED = [
    "data.dataset._target_=tests.unit.test_validation_split.numbered",
    "~data.dataset.num_points",
    "~data.dataset.num_test",
    "~data.dataset.low",
    "~data.dataset.high",
    "~data.dataset.seed",
]


def test_a_function_gets_the_validation_split_and_may_be_judged_by_it(tmp_path: Path) -> None:
    # numbered: 1,000 training samples whose targets are their ids 0..999, 200 test (1000..1199).
    overrides = [
        *NUMBERED,
        "trainer.fn._target_=returned_values.mean_ids",
        "data.val_fraction=0.1",
        "data.val_seed=5",
        "trainer.objective=val/mean_id",
    ]
    summary = function_in_process(overrides, tmp_path / "run")
    held = torch.randperm(1000, generator=torch.Generator().manual_seed(5))[:100]  # the split, from its definition
    assert summary["result"]["val/mean_id"] == pytest.approx(held.double().mean().item())
    assert summary["result"]["mean_id"] == pytest.approx(1099.5)
    assert summary["objective_name"] == "val/mean_id" and summary["objective"] == summary["result"]["val/mean_id"]


def test_a_function_without_a_val_set_parameter_is_refused_where_the_data_has_one(tmp_path: Path) -> None:
    from dtf.errors import UserError

    with pytest.raises(UserError, match=r"^the data has a validation split but returned_values\.accuracy takes no "):
        function_in_process(
            ["trainer.fn._target_=returned_values.accuracy", "data.val_fraction=0.1", *SMALL], tmp_path / "run"
        )


def _attributes_on_ranks(rank: int, world_size: int, run_dir: Path) -> None:
    from dtf.config.typed import typed
    from dtf.dist import env as dist_env
    from dtf.train import function

    torch.set_num_threads(1)
    env = dist_env.init("cpu", "gloo", 60.0)
    overrides = ["trainer=function", "trainer.fn._target_=returned_values.reads_its_datasets_attributes"]
    cfg = compose_config([f"launcher.nproc={world_size}", *overrides, "trainer.objective=test/test_rows"])
    function.run(typed(cfg), env, run_dir, None)


def test_a_functions_datasets_keep_their_own_attributes_and_give_its_share(tmp_path: Path) -> None:
    from tests.helpers.gloo import run_on_ranks

    # the default data: 10,000 points, 2,000 of them the test split, in TensorDatasets; 2 ranks, each
    # checking that indexing and len() are its own share while .tensors is the whole set
    run_on_ranks(_attributes_on_ranks, 2, tmp_path)
    result = json.loads((tmp_path / "summary.json").read_text())["result"]
    assert result["train_rows"] == 8000 and result["test_rows"] == 2000
