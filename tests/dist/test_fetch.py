"""data.fetch on 2 gloo ranks: by batch or per sample, the same training, bit for bit."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.inprocess import train_on_ranks

RUN = ["trainer.max_epochs=2", "data.dataset.num_points=1000", "data.dataset.num_test=101", "data.drop_last=true"]


def test_two_ranks_train_to_the_same_parameters_by_batch_and_per_sample(tmp_path: Path) -> None:
    runs = train_on_ranks(2, [(mode, [f"data.fetch={mode}", *RUN]) for mode in ("per_sample", "batched")], tmp_path)
    assert runs["batched"]["params_sha256"] == runs["per_sample"]["params_sha256"]
    assert runs["batched"]["test_loss_per_epoch"] == runs["per_sample"]["test_loss_per_epoch"]
    assert runs["batched"]["data_dropped_per_epoch"] == runs["per_sample"]["data_dropped_per_epoch"] > 0
