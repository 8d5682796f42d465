"""Map-style datasets through torch's DataLoader, sharded across ranks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dtf.data.even import EvalShardSampler
from dtf.dist.env import DistEnv
from dtf.errors import UserError


@dataclass
class TrainData:
    """One epoch of this rank's batches; len() is identical on every rank."""

    loader: DataLoader
    sampler: DistributedSampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

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
    sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, num_replicas=env.world_size, rank=env.rank, shuffle=cfg.shuffle, seed=seed, drop_last=cfg.drop_last
    )
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, drop_last=cfg.drop_last, **common)
    if len(train_loader) == 0:
        raise UserError(
            f"data.batch_size={cfg.batch_size} with drop_last leaves no batch for a rank "
            f"({len(sampler)} samples each): lower data.batch_size or set data.drop_last=false"
        )
    train = TrainData(train_loader, sampler)
    if test_set is None:
        return train, None
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    eval_sampler = EvalShardSampler(len(test_set), env.rank, env.world_size)  # type: ignore[arg-type]
    test_loader = DataLoader(test_set, batch_size=eval_bs, sampler=eval_sampler, **common)
    return train, EvalData(test_loader, eval_sampler, eval_bs)


def describe(data: TrainData) -> str:
    return f"{data.num_samples} samples, {len(data)} batches per rank per epoch"
