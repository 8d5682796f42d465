"""Labels as users store them: a scalar column, a flat target tensor, integer class indices as
floats. The loss must see them shaped like the model's output, or refuse in one line, on every
data source: never broadcast (B, 1) against (B,) into (B, B) and train on the wrong target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dtf.data.datasets import scalar_field
from dtf.errors import UserError
from tests.helpers.inprocess import train_in_process

IN_ORDER = ["trainer.max_epochs=5", "checkpoint.every_n_steps=null"]


def _write_columns(path: Path, x: torch.Tensor, z: torch.Tensor) -> str:
    """The default job's data as a pandas or Spark user writes it: float columns x1, x2 and a scalar label z."""
    path.mkdir(parents=True)
    table = pa.table({"x1": x[:, 0].numpy(), "x2": x[:, 1].numpy(), "z": z.reshape(-1).numpy()})
    pq.write_table(table, path / "part-0.parquet", row_group_size=1000)
    return f"file://{path}"


@pytest.fixture(scope="module")
def field_parquet(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    train, test = scalar_field()
    root = tmp_path_factory.mktemp("field")
    return _write_columns(root / "train", *train.tensors), _write_columns(root / "test", *test.tensors)


def test_a_scalar_label_column_trains_like_the_same_data_in_memory(
    tmp_path: Path, field_parquet: tuple[str, str]
) -> None:
    # One rank, no shuffling, the remainder dropped by both: the very same batches in the same order.
    memory = train_in_process([*IN_ORDER, "data.shuffle=false", "data.drop_last=true"], tmp_path / "memory")
    train, test = field_parquet
    parquet = train_in_process(
        [
            *IN_ORDER,
            "data=petastorm",
            f"data.path={train}",
            f"data.test_path={test}",
            "data.feature_columns=[x1,x2]",
            "data.label_column=z",
            "data.shuffle_row_groups=false",
            "data.shuffle_rows=false",
            "data.canonical_partitions=1",  # one partition: the stored rows in order
        ],
        tmp_path / "parquet",
    )
    assert memory is not None and parquet is not None
    assert memory["final_test_loss"] < 0.05  # it learned the field
    assert parquet["final_test_loss"] == pytest.approx(memory["final_test_loss"], rel=1e-5)
    assert parquet["train_loss_per_epoch"] == pytest.approx(memory["train_loss_per_epoch"], rel=1e-5)


def flat_targets(**kwargs: Any) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """scalar_field with targets of shape (N,) instead of (N, 1), as many user datasets hold them."""
    pairs = scalar_field(**kwargs)
    return tuple(torch.utils.data.TensorDataset(x, y.reshape(-1)) for x, y in (p.tensors for p in pairs))  # type: ignore[return-value]


def test_flat_targets_of_an_in_memory_dataset_train_like_column_targets(tmp_path: Path) -> None:
    args = ["trainer.max_steps=40", "data.dataset.num_points=2400", "data.dataset.num_test=400", *IN_ORDER[1:]]
    column = train_in_process(args, tmp_path / "column")
    flat = train_in_process([*args, "data.dataset._target_=tests.unit.test_labels.flat_targets"], tmp_path / "flat")
    assert column is not None and flat is not None
    assert flat["params_sha256"] == column["params_sha256"]
    assert flat["final_test_loss"] == column["final_test_loss"]


def three_targets(**kwargs: Any) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    pairs = scalar_field(**kwargs)
    return tuple(torch.utils.data.TensorDataset(x, y.repeat(1, 3)) for x, y in (p.tensors for p in pairs))  # type: ignore[return-value]


def test_a_label_that_would_broadcast_is_refused_naming_the_shapes(tmp_path: Path) -> None:
    args = [
        "trainer.max_steps=2",
        "data.dataset.num_points=2400",
        "data.dataset.num_test=400",
        "data.dataset._target_=tests.unit.test_labels.three_targets",
    ]
    with pytest.raises(UserError) as e:
        train_in_process(args, tmp_path / "run")
    message = str(e.value)
    assert "data.dataset" in message and "(32, 3)" in message and "(32, 1)" in message and "\n" not in message


def test_class_indices_stored_as_floats_reach_cross_entropy_as_indices(tmp_path: Path) -> None:
    # Spark writes most label columns as double: 3.0 is class 3
    from dtf.train.loss import TargetsLikeOutput

    loss = TargetsLikeOutput(torch.nn.CrossEntropyLoss(), "data.label_column=y")
    logits = torch.randn(4, 5)
    labels = torch.tensor([3.0, 0.0, 4.0, 1.0])
    assert loss(logits, labels) == torch.nn.functional.cross_entropy(logits, labels.long())
    with pytest.raises(UserError, match=r"data\.label_column=y"):
        loss(logits, torch.tensor([0.5, 1.0, 2.0, 3.0]))
    # integer regression targets become floats of the output's dtype
    mse = TargetsLikeOutput(torch.nn.MSELoss(), "data.label_column=y")
    out = torch.randn(4, 1)
    assert mse(out, torch.tensor([1, 2, 3, 4])) == torch.nn.functional.mse_loss(
        out, torch.tensor([[1.0], [2], [3], [4]])
    )
