"""The data of a run: the interface the trainer uses, and map-style datasets through torch's
DataLoader, sharded across ranks (training, validation and test splits). `data=parquet` is built
by dtf.data.parquet behind the same interface."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader, Dataset, Subset

from dtf import signals
from dtf.config.schema import LoaderDataConfig, ParquetDataConfig, TextDataConfig
from dtf.config.typed import DataConfig
from dtf.data.fetch import TensorBatches, fetching
from dtf.data.interface import DataSplits, TrainData
from dtf.data.samplers import EvalShardSampler, ResumableDistributedSampler
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.helper_process import quiet_when_a_receiver_dies


@dataclass
class LoaderTrainData:
    """One epoch of this rank's batches; len() (a whole epoch) is identical on every rank."""

    loader: DataLoader
    sampler: ResumableDistributedSampler
    batch_size: int
    batches_per_epoch: int
    fetched_by_batch: bool = False  # data.fetch (dtf.data.fetch)
    # Tensors in this process (no workers, no pinning), fetched by batch: the batches are cut out
    # of them here, without the DataLoader's per-batch machinery (~40 us a batch, most of a small
    # model's gap to a hand-written loop that indexes its tensors).
    in_memory: TensorBatches | None = None
    # The samples consumed mid-epoch are a prefix of the sampler's global order, on any world size.
    position_survives_world_size_change = True
    num_partitions = None

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        if self.in_memory is not None:
            return self.in_memory.batches(self.sampler, self.batch_size, self.loader.drop_last)
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


def start_worker(worker_id: int) -> None:
    """worker_init_fn of the DataLoader workers: the rank handles stop signals, its workers ignore
    them (dtf.signals.ignore_stop_signals). Torch installs its own SIGTERM handler in a worker
    before this runs; a worker still exits when the DataLoader shuts it down or the rank dies, and
    says nothing of a rank that died while collecting a batch (helper_process.quiet_when_a_receiver_dies)."""
    signals.ignore_stop_signals()
    quiet_when_a_receiver_dies()


@dataclass(frozen=True)
class Datasets:
    """The map-style datasets of data.dataset, by split."""

    train: Dataset
    val: Dataset | None
    test: Dataset | None


def split_datasets(dataset_cfg: Any) -> tuple[Dataset, Dataset | None]:
    """(train, test) of data.dataset (a builder that gives a validation split is refused here:
    the callers of this one have no use for it)."""
    built = datasets_built(dataset_cfg)
    if built.val is not None:
        raise UserError("data.dataset gives a validation split, which this command does not use: give (train, test)")
    return built.train, built.test


SPLIT_NAMES = {"train": "train", "val": "val", "validation": "val", "test": "test"}


def datasets_built(dataset_cfg: Any) -> Datasets:
    """What data.dataset builds: a Dataset (train only), (train, test), (train, val, test), or a
    mapping of train and val and/or test."""
    built = instantiate(dataset_cfg)
    if isinstance(built, Mapping):
        unknown = [k for k in built if k not in SPLIT_NAMES]
        if unknown or "train" not in built:
            raise UserError(
                f"data.dataset built a mapping with the keys {sorted(built)}: give train, and val (or validation) "
                "and/or test"
            )
        splits = {SPLIT_NAMES[k]: v for k, v in built.items()}
        return Datasets(splits["train"], splits.get("val"), splits.get("test"))
    if isinstance(built, tuple | list):
        if len(built) == 2:
            return Datasets(built[0], None, built[1])
        if len(built) == 3:
            return Datasets(built[0], built[1], built[2])
        raise UserError(
            "data.dataset must build a Dataset, a (train, test) pair or a (train, val, test) triple; got a "
            f"sequence of {len(built)}"
        )
    return Datasets(built, None, None)


def datasets_of(cfg: LoaderDataConfig) -> Datasets:
    """data.dataset's splits, with data.val_fraction of the training set held out for validation."""
    built = datasets_built(cfg.dataset)
    if not cfg.val_fraction:
        return built
    if built.val is not None:
        raise UserError(
            f"data.val_fraction={cfg.val_fraction}: data.dataset gives a validation split of its own; "
            "use it (data.val_fraction=0) or build none"
        )
    train, val = hold_out(built.train, cfg.val_fraction, cfg.val_seed)
    return Datasets(train, val, built.test)


def hold_out(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(the rest, the held-out fraction) of dataset: round(fraction x n) samples drawn with seed,
    both kept in the dataset's own order. A pure function of (n, fraction, seed): the same split on
    any world size."""
    n = len(dataset)  # type: ignore[arg-type]
    k = round(fraction * n)
    if not 0 < k < n:
        raise UserError(
            f"data.val_fraction={fraction} of {n} training samples holds out {k}: leave at least one sample "
            "on each side (a larger or smaller fraction)"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held, rest = order[:k].sort().values.tolist(), order[k:].sort().values.tolist()
    return Subset(dataset, rest), Subset(dataset, held)


def build_splits(cfg: DataConfig, env: DistEnv, seed: int, recorded_partitions: int | None = None) -> DataSplits:
    """recorded_partitions: the canonical partitions of the checkpoint a resumed run starts from (Parquet)."""
    if isinstance(cfg, ParquetDataConfig):
        from dtf.data.parquet import data as parquet  # pyarrow: only for runs that read Parquet

        return parquet.build_splits(cfg, env, seed, recorded_partitions)
    if isinstance(cfg, TextDataConfig):
        from dtf.data import text  # tokenizers and pyarrow: only for runs that read text

        return text.build_splits(cfg, env, seed, recorded_partitions)
    built = datasets_of(cfg)
    train, test = from_datasets(built.train, built.test, cfg, env, seed)
    val = eval_data(built.val, cfg, env, seed) if built.val is not None else None
    return DataSplits(train, val, test)


def from_datasets(
    train_set: Dataset, test_set: Dataset | None, cfg: LoaderDataConfig, env: DistEnv, seed: int
) -> tuple[LoaderTrainData, LoaderEvalData | None]:
    """DataLoaders over already built datasets, with the settings of cfg (all but cfg.dataset)."""
    if len(train_set) < env.world_size:  # type: ignore[arg-type]
        raise UserError(
            f"data.dataset has {len(train_set)} training samples for {env.world_size} ranks: "  # type: ignore[arg-type]
            "give it at least one sample per rank"
        )
    common = _loader_options(cfg, env)
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
    direct = cfg.num_workers == 0 and not common["pin_memory"]
    in_memory = source if direct and isinstance(source, TensorBatches) else None
    train = LoaderTrainData(train_loader, sampler, cfg.batch_size, len(train_loader), by_batch, in_memory)
    return train, eval_data(test_set, cfg, env, seed) if test_set is not None else None


def eval_data(dataset: Dataset, cfg: LoaderDataConfig, env: DistEnv, seed: int) -> LoaderEvalData:
    """Evaluation batches of a dataset (validation or test): every sample on exactly one rank."""
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    sampler = EvalShardSampler(len(dataset), env.rank, env.world_size)  # type: ignore[arg-type]
    source, collate, _ = fetching(dataset, cfg.fetch)
    loader = DataLoader(
        source,
        collate_fn=collate,
        batch_size=eval_bs,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed),
        **_loader_options(cfg, env),
    )
    return LoaderEvalData(loader, sampler, eval_bs)


def _loader_options(cfg: LoaderDataConfig, env: DistEnv) -> dict[str, Any]:
    return dict(
        num_workers=cfg.num_workers,
        worker_init_fn=start_worker if cfg.num_workers > 0 else None,
        pin_memory=cfg.pin_memory and env.device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )


def describe(data: TrainData) -> str:
    return data.describe()
