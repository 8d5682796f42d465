"""What the trainer needs of a run's data, whatever reads it (dtf.data.loader for map-style
datasets, dtf.data.parquet for Parquet)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol


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


@dataclass(frozen=True)
class DataSplits:
    """A run's data: training batches, and the validation and test sets where there are any."""

    train: TrainData
    val: EvalData | None
    test: EvalData | None
