"""data.fetch: a batch in one indexing op per tensor gives the batches torch's per-sample fetch
gives, bit for bit (shuffled or not, drop_last or not, resumed mid-epoch, evaluation's padding),
on real digits that dtf did not make; and where a dataset cannot be fetched by batch, auto falls
back and batched refuses in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from dtf.config.schema import Fetch, LoaderDataConfig
from dtf.data.loader import from_datasets
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from tests.helpers.inprocess import train_in_process


@pytest.fixture(scope="module")
def digits() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1,797 handwritten 8x8 digits, as they ship: float pixels, int64 labels."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images, labels = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8), torch.tensor(y)
    return TensorDataset(images[:1500], labels[:1500]), TensorDataset(images[1500:], labels[1500:])


def _loaders(train: Dataset, test: Dataset, fetch: Fetch, world: int, rank: int, **settings: Any) -> Any:
    cfg = LoaderDataConfig(batch_size=7, eval_batch_size=10, fetch=fetch, **settings)
    return from_datasets(
        train, test, cfg, DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu")), seed=3
    )


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b) and len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_batched_fetch_gives_the_per_sample_batches_bit_for_bit(
    digits: tuple[TensorDataset, TensorDataset], world: int, shuffle: bool, drop_last: bool
) -> None:
    train, test = digits
    for rank in range(world):
        settings = dict(shuffle=shuffle, drop_last=drop_last)
        (ps_train, ps_test), (b_train, b_test) = (
            _loaders(train, test, mode, world, rank, **settings) for mode in (Fetch.per_sample, Fetch.batched)
        )
        assert b_train.fetched_by_batch and not ps_train.fetched_by_batch
        assert b_train.in_memory is not None  # cut out of the tensors directly, without the DataLoader
        assert "fetched by batch" in b_train.describe() and "fetched per sample" in ps_train.describe()
        assert (len(b_train), b_train.num_dropped_per_epoch, b_train.num_repeated_per_epoch) == (
            len(ps_train),
            ps_train.num_dropped_per_epoch,
            ps_train.num_repeated_per_epoch,
        )
        for epoch, start in ((0, 0), (1, 0), (1, 5)):  # (1, 5): resumed at batch 5 of epoch 1
            ps_train.set_epoch(epoch, start), b_train.set_epoch(epoch, start)
            ps, b = list(ps_train), list(b_train)
            assert len(ps) == len(b) == len(ps_train) - start
            for x, y in zip(ps, b, strict=True):
                _same(x, y)
        for i, (x, y) in enumerate(zip(ps_test, b_test, strict=True)):
            _same(x, y)
            assert ps_test.num_real_in_batch(i) == b_test.num_real_in_batch(i)


def test_a_subset_of_a_tensor_dataset_is_fetched_by_batch_too(digits: tuple[TensorDataset, TensorDataset]) -> None:
    train, test = digits
    subset = Subset(Subset(train, list(range(1000, 0, -3))), list(range(0, 300, 2)))
    ps, b = (_loaders(subset, test, mode, 2, 1)[0] for mode in (Fetch.per_sample, Fetch.auto))
    assert b.fetched_by_batch
    for x, y in zip(ps, b, strict=True):
        _same(x, y)


class _PerSampleOnly(Dataset):
    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return self.data[i]


class _WithGetitems(_PerSampleOnly):
    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [self.data[i] for i in indices]


def test_auto_falls_back_to_per_sample_and_batched_refuses_in_one_line(
    digits: tuple[TensorDataset, TensorDataset],
) -> None:
    train, test = digits
    assert not _loaders(_PerSampleOnly(train), test, Fetch.auto, 1, 0)[0].fetched_by_batch
    assert _loaders(_WithGetitems(train), test, Fetch.batched, 1, 0)[0].fetched_by_batch  # torch calls it
    with pytest.raises(UserError, match=r"^data.fetch=batched: data.dataset \(a _PerSampleOnly\) cannot be indexed"):
        _loaders(_PerSampleOnly(train), test, Fetch.batched, 1, 0)


def test_the_default_job_trains_to_the_same_parameters_either_way(tmp_path: Path) -> None:
    runs = {
        mode: train_in_process(
            [f"data.fetch={mode}", "trainer.max_epochs=2", "data.dataset.num_points=1000", "data.dataset.num_test=100"],
            tmp_path / mode,
        )
        for mode in ("per_sample", "batched")
    }
    assert runs["batched"]["params_sha256"] == runs["per_sample"]["params_sha256"]
    assert runs["batched"]["final_test_loss"] == runs["per_sample"]["final_test_loss"]


def test_batched_fetch_in_loader_workers_gives_the_same_batches(digits: tuple[TensorDataset, TensorDataset]) -> None:
    train, test = digits
    ps = _loaders(train, test, Fetch.per_sample, 2, 0)[0]
    in_workers = _loaders(train, test, Fetch.batched, 2, 0, num_workers=2)[0]
    assert in_workers.in_memory is None  # the DataLoader's workers fetch them
    for epoch in (0, 1):
        ps.set_epoch(epoch), in_workers.set_epoch(epoch)
        for x, y in zip(ps, in_workers, strict=True):
            _same(x, y)
