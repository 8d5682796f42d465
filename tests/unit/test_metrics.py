"""Metrics beyond the loss, in process on one rank: each checked against a formula or a computation
of its own on the exported model, and the objective a run is judged by."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dtf.errors import UserError
from dtf.preflight import validate
from tests.helpers.inprocess import compose, train_in_process

# scikit-learn's digits: 1,438 training and 359 test images; a few steps of the Horovod CNN.
DIGITS = ["+experiment=digits_cnn", "scheduler=none", "data.batch_size=32", "checkpoint.every_n_steps=null"]


def _digits_test_set() -> tuple[torch.Tensor, torch.Tensor]:
    from dtf.data.datasets import digits

    _, test = digits()
    return test.tensors


def _predict(run_dir: Path, x: torch.Tensor) -> torch.Tensor:
    from dtf.models.mnist_cnn import MnistCNN

    model = MnistCNN()
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))
    model.eval()
    with torch.no_grad():
        return model(x)


def test_rmse_is_the_square_root_of_the_test_mse(tmp_path: Path) -> None:
    s = train_in_process(
        ["trainer.max_steps=30", "data.dataset.num_points=2400", "data.dataset.num_test=400"], tmp_path
    )
    final = s["final_metrics"]
    assert final["test/rmse"] == pytest.approx(math.sqrt(final["test/loss"]), rel=1e-6)
    assert final["test/loss"] == s["final_test_loss"] and final["train/loss"] == s["final_train_loss"]
    assert (s["objective_name"], s["objective_mode"], s["objective"]) == ("test/loss", "min", s["final_test_loss"])


def test_classification_metrics_equal_a_computation_on_the_whole_test_set(tmp_path: Path) -> None:
    s = train_in_process(
        [
            *DIGITS,
            "trainer.max_steps=45",
            "metrics=[accuracy,accuracy_top5,f1,auroc]",
            "trainer.objective=test/accuracy",
            "trainer.objective_mode=max",
        ],
        tmp_path,
    )
    x, y = _digits_test_set()
    scores = _predict(tmp_path, x)
    top1 = (scores.argmax(1) == y).double().mean().item()
    top5 = (scores.topk(5, dim=1).indices == y[:, None]).any(1).double().mean().item()
    f1_per_class = []
    for c in range(10):  # F1 by its definition, per class, then the plain mean over classes
        pred, true = scores.argmax(1) == c, y == c
        tp, fp, fn = (pred & true).sum().item(), (pred & ~true).sum().item(), (~pred & true).sum().item()
        f1_per_class.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    from sklearn.metrics import roc_auc_score

    auroc = roc_auc_score(y.numpy(), torch.softmax(scores, 1).numpy(), multi_class="ovr", average="macro")
    final = s["final_metrics"]
    assert final["test/accuracy"] == pytest.approx(top1, abs=1e-6)
    assert 0.3 < top1 < 1.0  # it learned something, and not everything: the check can fail
    assert final["test/accuracy_top5"] == pytest.approx(top5, abs=1e-6)
    assert final["test/f1"] == pytest.approx(sum(f1_per_class) / 10, abs=1e-6)
    assert final["test/auroc"] == pytest.approx(auroc, abs=1e-5)
    assert (s["objective_name"], s["objective_mode"]) == ("test/accuracy", "max")
    assert s["objective"] == final["test/accuracy"]
    epochs = s["metrics_per_epoch"]
    assert [e["epoch"] for e in epochs] == [1] and epochs[-1]["test/accuracy"] == final["test/accuracy"]


def test_a_user_step_that_masks_samples_masks_them_for_the_metrics_too(tmp_path: Path) -> None:
    s = train_in_process(
        [
            "trainer.max_steps=5",
            "data.dataset.num_points=2400",
            "data.dataset.num_test=400",
            "+trainer.step_fn._target_=tests.unit.test_trainer._masked_step",
            "+trainer.step_fn._partial_=true",
        ],
        tmp_path,
    )
    # the masked MSE and the masked RMSE come from the same samples
    final = s["final_metrics"]
    assert final["test/rmse"] == pytest.approx(math.sqrt(final["test/loss"]), rel=1e-6)


@pytest.mark.parametrize("stop_at", [10, 45])  # mid-epoch 1 (45 steps per epoch at batch 32), its end
def test_training_metrics_resume_exactly_mid_epoch(tmp_path: Path, stop_at: int) -> None:
    args = [*DIGITS, "trainer.train_metrics=true", "metrics=[accuracy,auroc]", "trainer.max_epochs=2"]
    straight = train_in_process(args, tmp_path / "straight")
    train_in_process([*args, f"trainer.max_steps={stop_at}"], tmp_path / "resumed")
    resumed = train_in_process(args, tmp_path / "resumed")
    assert resumed["resumed_from_step"] == stop_at
    assert resumed["metrics_per_epoch"] == straight["metrics_per_epoch"]
    assert {"train/accuracy", "train/auroc", "test/accuracy"} <= set(straight["final_metrics"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss=nll"], "metrics.rmse (MeanSquaredError) judges a regression, but the loss (NLLLoss)"),
        (["metrics=accuracy"], "metrics.accuracy (MulticlassAccuracy) judges classes, but the loss (MSELoss)"),
        (
            ["model=deep_mlp", "~model.out_features", "loss=nll", "metrics=f1"],
            "metrics.f1.num_classes is not set (the model has no num_classes): set metrics.f1.num_classes=",
        ),
        (
            ["+metrics.bad._target_=torch.nn.Linear"],
            "metrics.bad._target_=torch.nn.Linear is not a torchmetrics Metric",
        ),
        (["trainer.objective=test/accuracy"], "trainer.objective=test/accuracy names no value this run computes"),
        (["trainer.objective=accuracy"], "trainer.objective=accuracy is invalid"),
        (["trainer.objective=train/rmse"], "needs the metrics on the training batches: set trainer.train_metrics=true"),
    ],
)
def test_metrics_that_cannot_work_are_refused_on_the_driver(overrides: list[str], message: str) -> None:
    with pytest.raises(UserError) as e:
        validate(compose(*overrides))
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss=nll"], "metrics.rmse (MeanSquaredError) judges a regression, but the loss (NLLLoss)"),
        (
            ["+metrics.bad._target_=torch.nn.Linear"],
            "metrics.bad._target_=torch.nn.Linear is not a torchmetrics Metric",
        ),
        (["metrics.rmse._target_=torchmetrics.Nope"], "metrics.rmse._target_=torchmetrics.Nope cannot be imported"),
    ],
)
def test_the_ranks_refuse_the_metrics_classes_the_driver_of_a_local_run_leaves_to_them(
    overrides: list[str], message: str
) -> None:
    from dtf.cli import check
    from dtf.errors import EveryRankUserError
    from dtf.train.metrics import Metrics

    cfg = compose(*overrides)
    check(cfg, starting=True)  # a local run's driver: the classes are the ranks' to check
    with pytest.raises(EveryRankUserError) as e:
        Metrics.build(cfg.metrics, torch.device("cpu"), cfg.loss)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+metrics.rmse.nokey=1", "Unexpected keyword arguments: `nokey`"),
        ("metrics.rmse.squared=maybe", "Expected argument `squared` to be a boolean"),
    ],
)
def test_settings_a_torchmetrics_class_refuses_are_one_line_naming_the_metric(override: str, message: str) -> None:
    # MeanSquaredError takes **kwargs, so no signature names its keys: torchmetrics itself refuses them.
    from dtf.errors import EveryRankUserError
    from dtf.train.metrics import Metrics

    cfg = compose(override)
    with pytest.raises(EveryRankUserError) as e:
        Metrics.build(cfg.metrics, torch.device("cpu"), cfg.loss)
    line = str(e.value)
    assert (
        line.startswith("metrics.rmse: torchmetrics.regression.MeanSquaredError refused its settings (ValueError: ")
        and message in line
    )
    assert "\n" not in line


def test_the_driver_of_a_local_run_does_not_import_torchmetrics_and_dtf_validate_does() -> None:
    # 2-3 s on every run's critical path (torchmetrics imports transformers and scipy.signal here).
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_module\n"
        "from dtf.cli import check\n"
        "with initialize_config_module(config_module='dtf.conf', version_base='1.3'):\n"
        "    cfg = compose(config_name='config')\n"
        "check(cfg, starting=True)\n"
        "print('torchmetrics' in sys.modules)\n"
        "check(cfg)\n"
        "print('torchmetrics' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "True"], done.stdout + done.stderr


def test_metrics_and_objectives_that_fit_are_accepted() -> None:
    validate(compose("+experiment=digits_cnn", "metrics=[accuracy,f1,auroc]", "trainer.objective=test/f1"))
    validate(compose("trainer.objective=train/rmse", "trainer.train_metrics=true"))
    validate(compose("metrics=none", "loss=nll", "trainer.objective=train/loss"))


def test_a_rank_imports_torchmetrics_only_for_a_run_with_metrics() -> None:
    # torchmetrics takes 2-3 s to import here (it imports transformers and scipy.signal when they are
    # installed): a function run or metrics=none must not pay it on every rank.
    import subprocess
    import sys

    code = "import sys, dtf.train.loop, dtf.train.function; print('torchmetrics' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
