"""Metrics are exact on any world size: on 1, 2 and 3 ranks a run's test metrics equal the same
metrics computed in one process on the whole test set with the model it exported. The digits test
set has 359 images, a prime: 2 and 3 ranks get uneven shares, padded to equal length, and the
padding must never count."""

from __future__ import annotations

import pytest
import torch
import torchmetrics.classification as tmc

from dtf.data.datasets import digits
from dtf.models.mnist_cnn import MnistCNN


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_test_metrics_on_any_world_size_equal_the_whole_test_set_in_one_process(dtf, nproc: int) -> None:  # type: ignore[no-untyped-def]
    run = dtf(
        "+experiment=digits_cnn",
        f"launcher.nproc={nproc}",
        "trainer.max_steps=20",
        "scheduler=none",
        "data.batch_size=50",  # 359 = 3 x 120 - 1: the last rank's last batch is partly padding
        "metrics=[accuracy,f1,auroc]",
        "+metrics.count._target_=user_metrics.SampleCount",  # a user's own Metric (tests/helpers)
        "checkpoint.every_n_steps=null",
    )
    model = MnistCNN()
    model.load_state_dict(torch.load(run.run_dir / "model.pt", weights_only=True))
    model.eval()
    _, test = digits()
    x, y = test.tensors
    assert len(y) == 359
    with torch.no_grad():
        scores = model(x)
    expected = {
        "accuracy": tmc.MulticlassAccuracy(num_classes=10, average="micro")(scores, y).item(),
        "f1": tmc.MulticlassF1Score(num_classes=10, average="macro")(scores, y).item(),
        "auroc": tmc.MulticlassAUROC(num_classes=10, average="macro")(scores, y).item(),
        "loss": torch.nn.functional.nll_loss(scores, y).item(),
    }
    final = run.summary["final_metrics"]
    assert final["test/count"] == 359  # every test sample exactly once, none of the padding
    for name, value in expected.items():
        # Counts are exact; scores computed in other batch shapes may differ in the last bits.
        assert final[f"test/{name}"] == pytest.approx(value, abs=1e-5), name
    # A model that tells classes apart (not one class for all), so that a miscounted sample shows.
    assert scores.argmax(1).unique().numel() >= 3 and expected["accuracy"] < 1.0
