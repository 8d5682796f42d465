"""The validation split, checked against the data themselves: the same samples on 1, 2 and 4 ranks,
disjoint from training and from test, every one evaluated exactly once, and the fraction asked for.

Samples carry their ids (in-memory: the target; Parquet: the label, tests/helpers/parquet_files.py),
so which ones a rank sees is read off its batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from dtf.config.schema import LoaderDataConfig, ParquetDataConfig
from dtf.data import loader
from dtf.data.interface import DataSplits, EvalData
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from tests.helpers.parquet_files import write_row_groups

N, N_TEST = 1000, 200


def numbered(num_train: int = N, num_test: int = N_TEST) -> tuple[TensorDataset, TensorDataset]:
    """A builder for data.dataset: sample i has features [i, -i] and target i (test: N + i)."""
    ids = torch.arange(num_train + num_test)
    x = torch.stack([ids, -ids], 1).float()
    return TensorDataset(x[:num_train], ids[:num_train]), TensorDataset(x[num_train:], ids[num_train:])


def numbered_triple() -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    train, test = numbered(N + 100, N_TEST)
    return TensorDataset(*train[:N]), TensorDataset(*train[N:]), test


def numbered_mapping() -> dict[str, Any]:
    train, val, test = numbered_triple()
    return {"train": train, "validation": val, "test": test}


def env(rank: int, world: int) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))


def memory(builder: str = "numbered", **settings: Any) -> LoaderDataConfig:
    dataset = OmegaConf.create({"_target_": f"tests.unit.test_validation_split.{builder}"})
    return LoaderDataConfig(dataset=dataset, batch_size=16, **settings)


def evaluated(data: EvalData) -> list[int]:
    """The ids a rank's evaluation counts (padding left out, as the trainer leaves it out)."""
    return [i for j, (_, y) in enumerate(data) for i in y[: data.num_real_in_batch(j)].tolist()]


def splits_on(cfg: Any, world: int) -> dict[str, list[int]]:
    """Every split's ids over all ranks: train as the ranks' first epoch trains them."""
    out: dict[str, list[int]] = {"train": [], "val": [], "test": []}
    for rank in range(world):
        splits: DataSplits = loader.build_splits(cfg, env(rank, world), seed=0)
        splits.train.set_epoch(0)
        out["train"] += [i for _, y in splits.train for i in y.reshape(-1).tolist()]
        for name in ("val", "test"):
            data = getattr(splits, name)
            out[name] += evaluated(data) if data is not None else []
    return out


def test_a_held_out_fraction_is_the_same_samples_on_every_world_size_disjoint_from_train_and_test() -> None:
    cfg = memory(val_fraction=0.15, val_seed=7)
    first = splits_on(cfg, 1)
    assert len(first["val"]) == len(set(first["val"])) == 150  # round(0.15 x 1000), each counted once
    assert set(first["val"]).isdisjoint(first["train"]) and set(first["val"]) <= set(range(N))
    assert set(first["train"]) | set(first["val"]) == set(range(N))  # nothing lost (one rank drops nothing)
    assert sorted(first["test"]) == list(range(N, N + N_TEST))
    for world in (2, 4):
        split = splits_on(cfg, world)
        assert sorted(split["val"]) == sorted(first["val"]), world
        assert set(split["train"]).isdisjoint(split["val"]) and sorted(split["test"]) == sorted(first["test"])
    # The draw is the seed's (not trainer.seed's), and another seed draws other samples.
    other = splits_on(memory(val_fraction=0.15, val_seed=8), 1)
    assert set(other["val"]) != set(first["val"]) and len(other["val"]) == 150


@pytest.mark.parametrize("builder", ["numbered_triple", "numbered_mapping"])
def test_a_dataset_that_gives_its_own_validation_split_is_evaluated_as_it_is(builder: str) -> None:
    split = splits_on(memory(builder), 2)
    assert sorted(split["val"]) == list(range(N, N + 100)) and sorted(split["test"]) == list(range(1100, 1300))
    with pytest.raises(UserError, match=r"data.val_fraction=0.1: data.dataset gives a validation split of its own"):
        loader.build_splits(memory(builder, val_fraction=0.1), env(0, 1), seed=0)


def test_bad_validation_settings_are_one_line_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"data.val_fraction=1.5 is invalid"):
        memory(val_fraction=1.5)
    with pytest.raises(UserError, match=r"holds out 0: leave at least one sample on each side"):
        loader.build_splits(memory(val_fraction=0.0001), env(0, 1), seed=0)
    with pytest.raises(UserError, match=r"data.val_fraction=0.1 and data.val_path/data.val_filters both"):
        ParquetDataConfig(path=str(tmp_path), val_fraction=0.1, val_path=str(tmp_path))


def parquet_splits(path: Path, world: int, **settings: Any) -> dict[str, list[int]]:
    return splits_on(ParquetDataConfig(path=str(path), batch_size=8, **settings), world)


@pytest.mark.parametrize("fraction", [0.1, 0.37])
def test_a_held_out_fraction_of_parquet_rows_is_exact_and_the_same_on_every_world_size(
    tmp_path: Path, fraction: float
) -> None:
    # Skewed row groups over three files: the held-out rows are whole row groups and part of one.
    path = write_row_groups(tmp_path / "data", [[300, 7, 120], [0, 64], [211, 90, 8]])
    rows = 800
    test = write_row_groups(tmp_path / "test", [[50, 30]], first_id=10_000)
    first = parquet_splits(path, 1, val_fraction=fraction, val_seed=3, test_path=str(test), remainder="pad")
    assert len(first["val"]) == len(set(first["val"])) == round(fraction * rows)
    assert set(first["val"]).isdisjoint(first["train"]) and set(first["train"]) | set(first["val"]) == set(range(rows))
    assert sorted(first["test"]) == list(range(10_000, 10_080))
    for world in (2, 4):
        split = parquet_splits(path, world, val_fraction=fraction, val_seed=3, test_path=str(test), remainder="pad")
        assert sorted(split["val"]) == sorted(first["val"]) and set(split["train"]).isdisjoint(split["val"])
        assert set(split["train"]) == set(first["train"]), world  # pad repeats rows, from the same rest


def test_parquet_validation_by_path_or_by_partition_filter(tmp_path: Path) -> None:
    for split, first in (("train", 0), ("val", 1000), ("test", 2000)):
        write_row_groups(tmp_path / "root" / f"split={split}", [[40, 17]], first_id=first)
    root = tmp_path / "root"
    by_filter = parquet_splits(
        root,
        2,
        filters=[["split", "=", "train"]],
        val_filters=[["split", "=", "val"]],
        test_filters=[["split", "=", "test"]],
    )
    assert sorted(by_filter["val"]) == list(range(1000, 1057)) and sorted(by_filter["test"]) == list(range(2000, 2057))
    by_path = parquet_splits(root / "split=train", 2, val_path=str(root / "split=val"))
    assert sorted(by_path["val"]) == list(range(1000, 1057)) and by_path["test"] == []
