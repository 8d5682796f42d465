"""data=petastorm on data that users already have, written by pyarrow, pandas and Spark (not by dtf).

Batches are checked against the files as pyarrow or pandas read them. The Spark-written data
sets are written once per test session (tests/helpers/user_datasets.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from dtf.config.schema import PetastormDataConfig
from dtf.data import parquet
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from tests.helpers.parquet_files import write_row_groups


def config(path: Path | str, **settings: Any) -> DictConfig:
    return OmegaConf.structured(PetastormDataConfig(path=str(path), **settings))


def env(rank: int = 0, world: int = 1) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))


def epoch_labels(cfg: DictConfig, number: int, world: int = 1) -> list[list[int]]:
    """Each rank's labels in epoch `number`, in the order they are trained on."""
    out = []
    for rank in range(world):
        data, _ = parquet.build(cfg, env(rank, world), seed=0)
        data.set_epoch(number)
        out.append(torch.cat([y for _, y in data]).tolist())
    return out


def test_empty_files_and_zero_row_row_groups_are_skipped_in_training_and_evaluation(tmp_path: Path) -> None:
    # pyarrow writes an empty table as one row group of 0 rows; a writer may also leave one between others.
    path = write_row_groups(tmp_path / "data", [[40], [0], [25, 0, 10], [0]])
    for world in (2, 3):
        cfg = config(path, batch_size=5, test_path=str(path))
        for number in range(4):  # the row-group order is shuffled: an empty one lands anywhere in some epoch
            per_rank = epoch_labels(cfg, number, world)
            assert {len(r) for r in per_rank} == {75 // (5 * world) * 5}
            used = [i for r in per_rank for i in r]
            assert len(set(used)) == len(used) and set(used) <= set(range(75))
        evaluated = []
        for rank in range(world):
            _, test = parquet.build(cfg, env(rank, world), seed=0)
            assert test is not None
            evaluated += [i for j, (_, y) in enumerate(test) for i in y[: test.num_real_in_batch(j)].tolist()]
        assert sorted(evaluated) == list(range(75))
