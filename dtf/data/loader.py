"""Map-style datasets through torch's DataLoader, sharded across ranks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dtf.data.even import EvalShardSampler
from dtf.dist.env import DistEnv
from dtf.errors import UserError


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start the current epoch after its first `skip` samples
    (a mid-epoch resume); the next set_epoch() starts from the beginning again."""

    skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


@dataclass
class TrainData:
    """One epoch of this rank's batches; len() (a whole epoch) is identical on every rank."""

    loader: DataLoader
    sampler: ResumableDistributedSampler
    batch_size: int
    batches_per_epoch: int

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Start epoch `epoch` at its batch `start_batch` (> 0 only when resuming mid-epoch)."""
        self.sampler.set_epoch(epoch, skip=start_batch * self.batch_size)

    @property
    def num_samples(self) -> int:
        return len(self.sampler.dataset)  # type: ignore[arg-type]


@dataclass
class EvalData:
    """This rank's test batches; equal count on every rank, padding marked by num_real_in_batch."""

    loader: DataLoader
    sampler: EvalShardSampler
    batch_size: int

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def num_real_in_batch(self, batch_index: int) -> int:
        return self.sampler.num_real_in_batch(batch_index, self.batch_size)


def split_datasets(dataset_cfg: Any) -> tuple[Dataset, Dataset | None]:
    built = instantiate(dataset_cfg)
    if isinstance(built, tuple | list):
        if len(built) != 2:
            raise UserError(
                "data.dataset must build a Dataset or a (train, test) pair; got a sequence of "
                f"{len(built)}: return exactly two datasets"
            )
        return built[0], built[1]
    return built, None


def build(cfg: DictConfig, env: DistEnv, seed: int) -> tuple[TrainData, EvalData | None]:
    train_set, test_set = split_datasets(cfg.dataset)
    if len(train_set) < env.world_size:  # type: ignore[arg-type]
        raise UserError(
            f"data.dataset has {len(train_set)} training samples for {env.world_size} ranks: "  # type: ignore[arg-type]
            "give it at least one sample per rank"
        )
    common = dict(
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and env.device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )
    sampler = ResumableDistributedSampler(
        train_set, num_replicas=env.world_size, rank=env.rank, shuffle=cfg.shuffle, seed=seed, drop_last=cfg.drop_last
    )
    train_loader = DataLoader(
        train_set,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=cfg.drop_last,
        # Its own generator: creating an iterator (every epoch, and on a resume mid-epoch) then
        # draws the worker seed from it, not from the global RNG that dropout uses.
        generator=torch.Generator().manual_seed(seed + env.rank),
        **common,
    )
    if len(train_loader) == 0:
        raise UserError(
            f"data.batch_size={cfg.batch_size} with drop_last leaves no batch for a rank "
            f"({len(sampler)} samples each): lower data.batch_size or set data.drop_last=false"
        )
    train = TrainData(train_loader, sampler, cfg.batch_size, len(train_loader))
    if test_set is None:
        return train, None
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    eval_sampler = EvalShardSampler(len(test_set), env.rank, env.world_size)  # type: ignore[arg-type]
    test_loader = DataLoader(
        test_set, batch_size=eval_bs, sampler=eval_sampler, generator=torch.Generator().manual_seed(seed), **common
    )
    return train, EvalData(test_loader, eval_sampler, eval_bs)


def describe(data: TrainData) -> str:
    return f"{data.num_samples} samples, {len(data)} batches per rank per epoch"
