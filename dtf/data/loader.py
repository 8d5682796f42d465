"""The data of a run: the interface the trainer uses, and map-style datasets through torch's
DataLoader, sharded across ranks. `data=petastorm` (Parquet) is
built by dtf.data.parquet behind the same interface."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader, Dataset

from dtf import signals
from dtf.config.schema import LoaderDataConfig, ParquetDataConfig
from dtf.config.typed import DataConfig
from dtf.data.fetch import fetching
from dtf.data.samplers import EvalShardSampler, ResumableDistributedSampler
from dtf.dist.env import DistEnv
from dtf.errors import UserError


class TrainData(Protocol):
    """What the trainer needs of the training data, whatever reads it."""

    batch_size: int
    position_survives_world_size_change: bool

    def __len__(self) -> int:
        """Batches per epoch, identical on every rank."""
        ...

    def __iter__(self) -> Iterator[Any]:
        """This rank's batches of the current epoch, from its start batch on."""
        ...

    def set_epoch(self, epoch: int, start_batch: int = 0, read_ahead: bool = False) -> None:
        """Position: a pure function of (seed, epoch, start_batch, rank, world size), so resuming is exact.
        read_ahead: the next epoch follows this one (from its first batch), so its data may be read
        ahead during this one."""
        ...

    def close(self) -> None:
        """The run reads no more batches: stop what reads ahead."""
        ...

    @property
    def num_partitions(self) -> int | None:
        """The canonical partitions every epoch is cut into (Parquet: the same steps on any world
        size that divides it); None for data read in per-rank shares."""
        ...

    def seek(self, epoch: int, samples_in_epoch: int) -> int:
        """The batch a resumed run starts epoch `epoch` at, samples_in_epoch (over all ranks) of it
        used: the first batch whose samples were not all used, or (data that can) the batch that
        continues from the very sample reached."""
        ...

    def samples_after(self, num_batches: int) -> int:
        """Samples of an epoch used by its first num_batches batches, over all ranks."""
        ...

    @property
    def num_samples(self) -> int:
        """Samples (rows) in the training set."""
        ...

    @property
    def num_dropped_per_epoch(self) -> int:
        """Samples of the data set left out of an epoch, over all ranks."""
        ...

    @property
    def num_repeated_per_epoch(self) -> int:
        """Samples used twice in an epoch (padding), over all ranks."""
        ...

    def describe(self) -> str: ...


class EvalData(Protocol):
    """What the trainer needs of the test data: equal batch counts, padding marked per batch."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...

    def num_real_in_batch(self, batch_index: int) -> int:
        """Samples of batch batch_index that are real (a prefix); the rest is padding."""
        ...


@dataclass
class LoaderTrainData:
    """One epoch of this rank's batches; len() (a whole epoch) is identical on every rank."""

    loader: DataLoader
    sampler: ResumableDistributedSampler
    batch_size: int
    batches_per_epoch: int
    fetched_by_batch: bool = False  # data.fetch (dtf.data.fetch)
    # The samples consumed mid-epoch are a prefix of the sampler's global order, on any world size.
    position_survives_world_size_change = True
    num_partitions = None

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def set_epoch(self, epoch: int, start_batch: int = 0, read_ahead: bool = False) -> None:
        """Start epoch `epoch` at its batch `start_batch` (> 0 only when resuming mid-epoch). The
        DataLoader reads ahead within an epoch (its workers' prefetch), not across: read_ahead is not used."""
        self.sampler.set_epoch(epoch, skip=start_batch * self.batch_size)

    def close(self) -> None:
        """Nothing reads ahead across epochs here."""

    def seek(self, epoch: int, samples_in_epoch: int) -> int:
        start = min(len(self), samples_in_epoch // self.samples_after(1))
        while start < len(self) and self.samples_after(start + 1) <= samples_in_epoch:  # a short last batch
            start += 1
        return start

    def samples_after(self, num_batches: int) -> int:
        # Every rank's share has the same length (DistributedSampler pads or cuts); the last batch may be short.
        per_rank = min(self.sampler.num_samples, self.batches_per_epoch * self.batch_size)
        return min(num_batches * self.batch_size, per_rank) * self.sampler.num_replicas

    @property
    def num_samples(self) -> int:
        return len(self.sampler.dataset)  # type: ignore[arg-type]

    @property
    def _left_out_of_last_batch(self) -> int:
        """Per rank: samples the DataLoader's drop_last cuts off."""
        return self.sampler.num_samples - self.batches_per_epoch * self.batch_size if self.loader.drop_last else 0

    @property
    def num_dropped_per_epoch(self) -> int:
        cut = max(0, self.num_samples - self.sampler.total_size)  # DistributedSampler(drop_last=True)
        return cut + self.sampler.num_replicas * self._left_out_of_last_batch

    @property
    def num_repeated_per_epoch(self) -> int:
        return max(0, self.sampler.total_size - self.num_samples)  # DistributedSampler pads with repeats

    def describe(self) -> str:
        fetch = "by batch" if self.fetched_by_batch else "per sample"
        text = f"{self.num_samples} samples, {len(self)} batches per rank per epoch, fetched {fetch}"
        if self.num_dropped_per_epoch:
            text += f", {self.num_dropped_per_epoch} samples dropped per epoch"
        if self.num_repeated_per_epoch:
            text += f", {self.num_repeated_per_epoch} samples repeated per epoch"
        return text


@dataclass
class LoaderEvalData:
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


def ignore_stop_signals(worker_id: int) -> None:
    """worker_init_fn of the DataLoader workers: the rank handles stop signals, its workers ignore
    them (dtf.signals.ignore_stop_signals). Torch installs its own SIGTERM handler in a worker
    before this runs; a worker still exits when the DataLoader shuts it down or the rank dies."""
    signals.ignore_stop_signals()


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


def build(
    cfg: DataConfig, env: DistEnv, seed: int, recorded_partitions: int | None = None
) -> tuple[TrainData, EvalData | None]:
    """recorded_partitions: the canonical partitions of the checkpoint a resumed run starts from (Parquet)."""
    if isinstance(cfg, ParquetDataConfig):
        from dtf.data.parquet import data as parquet  # petastorm and pyarrow: only for runs that read Parquet

        return parquet.build(cfg, env, seed, recorded_partitions)
    train_set, test_set = split_datasets(cfg.dataset)
    return from_datasets(train_set, test_set, cfg, env, seed)


def from_datasets(
    train_set: Dataset, test_set: Dataset | None, cfg: LoaderDataConfig, env: DistEnv, seed: int
) -> tuple[LoaderTrainData, LoaderEvalData | None]:
    """DataLoaders over already built datasets, with the settings of cfg (all but cfg.dataset)."""
    if len(train_set) < env.world_size:  # type: ignore[arg-type]
        raise UserError(
            f"data.dataset has {len(train_set)} training samples for {env.world_size} ranks: "  # type: ignore[arg-type]
            "give it at least one sample per rank"
        )
    common: dict[str, Any] = dict(
        num_workers=cfg.num_workers,
        worker_init_fn=ignore_stop_signals if cfg.num_workers > 0 else None,
        pin_memory=cfg.pin_memory and env.device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )
    sampler = ResumableDistributedSampler(
        train_set, num_replicas=env.world_size, rank=env.rank, shuffle=cfg.shuffle, seed=seed, drop_last=cfg.drop_last
    )
    source, collate, by_batch = fetching(train_set, cfg.fetch)
    train_loader = DataLoader(
        source,
        collate_fn=collate,
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
    train = LoaderTrainData(train_loader, sampler, cfg.batch_size, len(train_loader), by_batch)
    if test_set is None:
        return train, None
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    eval_sampler = EvalShardSampler(len(test_set), env.rank, env.world_size)  # type: ignore[arg-type]
    test_source, test_collate, _ = fetching(test_set, cfg.fetch)
    test_loader = DataLoader(
        test_source,
        collate_fn=test_collate,
        batch_size=eval_bs,
        sampler=eval_sampler,
        generator=torch.Generator().manual_seed(seed),
        **common,
    )
    return train, LoaderEvalData(test_loader, eval_sampler, eval_bs)


def describe(data: TrainData) -> str:
    return data.describe()
