"""`data=parquet`: Parquet or a Petastorm dataset as train and test batches, equal in number on every rank.

Every epoch each rank plans its rows from the Parquet metadata (dtf.data.parquet.plan): the
epoch's canonical partitions it owns. It reads the row groups they touch (dtf.data.parquet.reader)
and makes every step's (features, labels) batch, the shape the default training step expects,
from the next rows of each of its partitions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import ListConfig

from dtf.config.schema import ParquetDataConfig
from dtf.data.interface import DataSplits
from dtf.data.parquet.plan import (
    EpochOrder,
    Partitions,
    Segment,
    Stream,
    batches_per_rank,
    choose_partitions,
    eval_share,
    remainder_rows,
    stream_of,
)
from dtf.data.parquet.reader import Columns, ReaderOptions, StepReading
from dtf.data.parquet.source import ParquetSource, open_sources
from dtf.dist.env import DistEnv
from dtf.errors import UserError

Batch = Any
Transform = Callable[[Batch], Batch]


_NUMPY_FLOAT: dict[torch.dtype, np.dtype] = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}


@dataclass(frozen=True)
class BatchLayout:
    """Which columns make the features and the label, the per-row shapes to give them, and the
    dtype features arrive in (the model's: integer pixels or counts would not pass a Linear layer)."""

    feature_columns: tuple[str, ...]
    label_column: str
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    feature_dtype: torch.dtype = torch.float32

    @property
    def columns(self) -> list[str]:
        return [*dict.fromkeys([*self.feature_columns, self.label_column])]

    def _shaped(self, values: np.ndarray, name: str) -> np.ndarray:
        shape = self.shapes.get(name)
        if shape is None or values.shape[1:] == shape:
            return values
        if math.prod(values.shape[1:]) != math.prod(shape):
            raise UserError(f"column {name!r} holds {values.shape[1:]} values per row, not the stored shape {shape}")
        return values.reshape(len(values), *shape)

    @property
    def float_dtype(self) -> np.dtype:
        """The numpy dtype arrays are cast to once per row group (to bfloat16, which numpy lacks, per batch)."""
        return _NUMPY_FLOAT.get(self.feature_dtype, np.dtype(np.float32))

    def arrays(self, cols: Columns) -> tuple[np.ndarray, np.ndarray]:
        features = [self._shaped(cols[name], name) for name in self.feature_columns]
        for name, values in zip(self.feature_columns, features, strict=True):
            if values.dtype.kind not in "iufb":
                raise UserError(f"data.feature_columns: column {name!r} holds {values.dtype} values; use numeric ones")
        # Several columns: one flat feature vector per row (a transform can reshape it). One scalar
        # column: a vector of one value per row, as a Linear layer with in_features=1 takes it.
        if len(features) == 1:
            x = features[0] if features[0].ndim > 1 else features[0].reshape(-1, 1)
        else:
            x = np.concatenate([f.reshape(len(f), -1) for f in features], axis=1)
        y = self._shaped(cols[self.label_column], self.label_column)
        return _writable(x.astype(self.float_dtype, copy=False)), _label_array(y, self.float_dtype)


def _writable(values: np.ndarray) -> np.ndarray:
    # Arrow's zero-copy arrays are read-only, which torch.from_numpy warns about: copy those.
    return values if values.flags.writeable else values.copy()


def _label_array(values: np.ndarray, float_dtype: np.dtype) -> np.ndarray:
    """Labels as stored: integers as int64 (class indices), floats in the features' float dtype."""
    if values.dtype.kind == "f":
        target = float_dtype
    elif values.dtype.kind in "iu":
        target = np.dtype(np.int64)
    elif values.dtype.kind == "b":
        target = np.dtype(np.bool_)
    else:
        raise UserError(f"data.label_column: values of type {values.dtype} cannot become a tensor; use numeric columns")
    return _writable(values.astype(target, copy=False))


def feature_dtype(name: str) -> torch.dtype:
    """data.feature_dtype: auto is torch's default dtype, the one a model's parameters are made in."""
    return torch.get_default_dtype() if name == "auto" else getattr(torch, name)


@dataclass
class _Stream:
    """What both train and test data need to turn planned segments into batches."""

    source: ParquetSource
    layout: BatchLayout
    reader: ReaderOptions
    transform: Transform | None

    def batches(self, segments: Sequence[Segment], batch_size: int) -> Iterator[Batch]:
        """The rows of segments in order, in batches of batch_size rows (the last one may be short)."""
        stream = stream_of(segments)
        bounds = [*range(0, len(stream), batch_size), len(stream)] if len(stream) else []
        reading = self.start_reading([stream], bounds)
        try:
            yield from self.steps(reading)
        finally:
            reading.close()

    def _finish(self, x: torch.Tensor, y: torch.Tensor) -> Batch:
        if x.dtype != self.layout.feature_dtype:  # bfloat16: no numpy dtype to cast to on the way
            dtype = self.layout.feature_dtype
            x, y = x.to(dtype), (y.to(dtype) if y.is_floating_point() else y)
        return self.transform((x, y)) if self.transform is not None else (x, y)

    def start_reading(self, streams: Sequence[Stream], bounds: Sequence[int] | np.ndarray) -> StepReading:
        """The reading of these steps, its workers started (they read ahead from now on)."""
        return StepReading(self.source, streams, bounds, self.layout.columns, self.reader)

    def steps(self, reading: StepReading, gathered: Callable[[], None] | None = None) -> Iterator[Batch]:
        """A reading's batches: each step's rows of every partition, concatenated in partition order
        (features and labels made a chunk of steps at a time, each batch a slice of them).
        gathered: called after each chunk of steps is gathered, before its batches are handed out."""
        for chunk, sizes in reading.chunks():
            if gathered is not None:
                gathered()
            x, y = self.layout.arrays(chunk)
            features, labels = torch.from_numpy(x), torch.from_numpy(y)
            batches = zip(features.split(sizes), labels.split(sizes), strict=True)  # views, made in one call each
            if self.transform is None and features.dtype == self.layout.feature_dtype:
                yield from batches  # nothing to finish: a call per batch would be most of the cost
            else:
                for x_, y_ in batches:
                    yield self._finish(x_, y_)


@dataclass
class ParquetTrainData:
    """One epoch of this rank's batches; len() (a whole epoch) is identical on every rank.

    The epoch is cut into num_partitions canonical partitions (dtf.data.parquet.plan.Partitions);
    every batch takes rows_per_step rows from each partition this rank owns. The global sequence
    of steps depends on the global batch and num_partitions, never on the world size."""

    stream: _Stream
    rank: int
    world_size: int
    batch_size: int
    seed: int
    shuffle_row_groups: bool
    shuffle_rows: bool
    pad: bool
    num_partitions: int
    epoch: int = 0
    start_batch: int = 0
    # A resume that continues the epoch from a row that is not on this global batch's grid (the
    # global batch changed): (epoch, its start batch, rows of every partition used before it).
    resume_row: tuple[int, int, int] | None = None
    # set_epoch's read_ahead: the next epoch follows this one, from its first batch.
    read_ahead: bool = False
    # The next epoch's reading, started during this one: ((epoch, start batch), reading).
    _ahead: tuple[tuple[int, int], StepReading] | None = field(default=None, repr=False, compare=False)
    # The rows consumed mid-epoch are the first samples_in_epoch / C rows of every partition,
    # whatever the world size: a resume on another one continues the same sequence.
    position_survives_world_size_change = True

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def rows_per_step(self) -> int:
        """b: the rows every batch takes from every partition."""
        return self.global_batch // self.num_partitions

    def __len__(self) -> int:
        return batches_per_rank(self.num_samples, self.world_size, self.batch_size, self.pad)

    @property
    def num_samples(self) -> int:
        return self.stream.source.num_rows

    @property
    def num_dropped_per_epoch(self) -> int:
        """Rows of the data set not used in an epoch (all ranks)."""
        return 0 if self.pad else remainder_rows(self.num_samples, self.world_size, self.batch_size, pad=False)

    @property
    def num_repeated_per_epoch(self) -> int:
        """Rows used twice in an epoch (all ranks), to fill every rank's last batch."""
        return remainder_rows(self.num_samples, self.world_size, self.batch_size, pad=True) if self.pad else 0

    def set_epoch(self, epoch: int, start_batch: int = 0, read_ahead: bool = False) -> None:
        """Start epoch `epoch` at its batch `start_batch` (> 0 only when resuming mid-epoch).

        read_ahead: the next epoch follows. Once all row groups of this epoch have arrived, this
        epoch's reader stops and the next one's starts: its first row groups (one per partition
        the rank owns) are read while this epoch's last steps use what arrived.
        """
        self.epoch, self.start_batch, self.read_ahead = epoch, start_batch, read_ahead

    def seek(self, epoch: int, samples_in_epoch: int) -> int:
        """The batch to start epoch `epoch` at, so that every partition continues from its row
        samples_in_epoch / C, the row it had reached (also when the global batch changed since:
        then the batches of the rest of the epoch start there). Applies to the next set_epoch."""
        used = samples_in_epoch // self.num_partitions
        b = self.rows_per_step
        remaining = max(0, self.partitions().rows_per_partition - used) // b
        start = len(self) - remaining
        self.resume_row = (epoch, start, used) if used != start * b else None
        return start

    def _grid_of(self, epoch: int, start_batch: int) -> tuple[int, int]:
        """(batch index, rows of every partition used before it) an epoch's batches count from."""
        if self.resume_row is not None and self.resume_row[:2] == (epoch, start_batch):
            return self.resume_row[1], self.resume_row[2]
        return 0, 0

    @property
    def _grid(self) -> tuple[int, int]:
        return self._grid_of(self.epoch, self.start_batch)

    def samples_after(self, num_batches: int) -> int:
        """Rows used by the epoch's first num_batches batches, over all ranks (every batch is full)."""
        first, used = self._grid
        return (used + (num_batches - first) * self.rows_per_step) * self.num_partitions

    def partitions(self, epoch: int | None = None) -> Partitions:
        """The canonical partitions of an epoch (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        order = EpochOrder(self.stream.source.piece_rows, self.seed, epoch, self.shuffle_row_groups, self.shuffle_rows)
        return Partitions(order, self.num_partitions, self.rows_per_step, self.pad)

    def streams(self, epoch: int, start_batch: int) -> list[Stream]:
        """This rank's partitions of an epoch from a batch on, in order of use: a pure function of
        the settings. Batch t (counted from start_batch) takes rows [t b, (t + 1) b) of each."""
        first, used = self._grid_of(epoch, start_batch)
        start_row = used + (start_batch - first) * self.rows_per_step
        return self.partitions(epoch).rank_streams(self.world_size, self.rank, start_row)

    def _start_reading(self, epoch: int, start_batch: int) -> StepReading:
        streams = self.streams(epoch, start_batch)
        steps = len(streams[0]) // self.rows_per_step
        return self.stream.start_reading(streams, np.arange(steps + 1) * self.rows_per_step)

    def __iter__(self) -> Iterator[Batch]:
        return self._batches(self.epoch, self.start_batch, self.read_ahead)

    def _batches(self, epoch: int, start_batch: int, read_ahead: bool) -> Iterator[Batch]:
        # A generator: the reading starts when the first batch is asked for, and stops when the
        # epoch is left, finished or not.
        reading = self._claim_ahead((epoch, start_batch)) or self._start_reading(epoch, start_batch)

        def start_next() -> None:
            # Before a chunk's batches: after an epoch's last batch the trainer asks for no more.
            # One pool at a time: this epoch's has nothing left to read (its steps use what arrived).
            if read_ahead and reading.all_arrived and self._ahead is None:
                reading.stop_workers()
                self._ahead = (epoch + 1, 0), self._start_reading(epoch + 1, 0)

        try:
            yield from self.stream.steps(reading, start_next)
        finally:
            reading.close()

    def _claim_ahead(self, key: tuple[int, int]) -> StepReading | None:
        """The reading started ahead, if it is of this epoch and start batch (else it is stopped)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead[0] == key:
            return ahead[1]
        ahead[1].close()
        return None

    def close(self) -> None:
        """Stop a reading started ahead for an epoch that will not be read (the run ends or stops)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].close()

    def describe(self) -> str:
        if self.pad:
            rest = f"{self.num_repeated_per_epoch} rows repeated per epoch (data.remainder=pad)"
        else:
            rest = f"{self.num_dropped_per_epoch} rows dropped per epoch (data.remainder=drop)"
        kind = "a Petastorm dataset (codecs decoded)" if self.stream.reader.row_reader else "Parquet"
        return (
            f"{self.stream.source.describe()} of {kind}, {len(self)} batches per rank per epoch, {rest}, "
            f"{self.num_partitions} canonical partitions"
        )


@dataclass
class ParquetEvalData:
    """This rank's test batches: equal count on every rank, padding marked by num_real_in_batch."""

    stream: _Stream
    batch_size: int
    segments: list[Segment]
    num_real: int

    def __len__(self) -> int:
        return math.ceil(sum(len(s) for s in self.segments) / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        return self.stream.batches(self.segments, self.batch_size)

    def num_real_in_batch(self, batch_index: int) -> int:
        return max(0, min(self.batch_size, self.num_real - batch_index * self.batch_size))


def build_transform(node: Any) -> Transform | None:
    """data.transform: one callable by _target_, or a list of them applied in order."""
    if not node:
        return None
    steps = [instantiate(t) for t in node] if isinstance(node, ListConfig | list) else [instantiate(node)]
    return steps[0] if len(steps) == 1 else Compose(steps)


@dataclass(frozen=True)
class Compose:
    """Transforms applied one after the other to each (features, labels) batch."""

    steps: Sequence[Transform]

    def __call__(self, batch: Batch) -> Batch:
        for step in self.steps:
            batch = step(batch)
        return batch


def _value(option: Any) -> str:
    return str(getattr(option, "value", option))


def _check_same_everywhere(fingerprint: str, env: DistEnv) -> None:
    """Ranks that see different files would plan different epochs and hang in the first mismatched collective."""
    if not dist.is_initialized() or env.world_size == 1:
        return
    seen: list[Any] = [None] * env.world_size
    dist.all_gather_object(seen, fingerprint)
    if any(other != seen[0] for other in seen):
        raise UserError(
            f"data.path: the ranks see different data ({'; '.join(f'rank {r}: {s}' for r, s in enumerate(seen))}): "
            "give every node the same files"
        )


def _workers(workers_count: int | str, src: ParquetSource, columns: Sequence[str], row_reader: bool) -> int:
    """data.workers_count, auto resolved: 2 where a codec other than ScalarCodec decodes a column read
    (OpenCV and zlib release the GIL: a second worker adds decoding), else 1 (Arrow's reading is
    cheap, and a second thread only takes the GIL from the training loop more often: for the
    reader of e07caaf, benchmarks/data.py gave 0.66 of the floor with 2 workers and 0.85
    with 1 on scalar_field; docs/data.md has the current reader's figures)."""
    if workers_count != "auto":
        return int(workers_count)
    fields = src.unischema.fields if row_reader and src.unischema is not None else {}
    decoded = [fields[c] for c in columns if c in fields and fields[c].codec is not None]
    return 2 if any(f.codec is not None and f.codec.kind != "scalar" for f in decoded) else 1


def build_splits(
    cfg: ParquetDataConfig,
    env: DistEnv,
    seed: int,
    recorded_partitions: int | None = None,
    *,
    layout: BatchLayout | None = None,
    train_class: type[ParquetTrainData] | None = None,
    eval_class: type[ParquetEvalData] | None = None,
) -> DataSplits:
    """recorded_partitions: data.canonical_partitions as the checkpoint a resumed run starts from recorded it.
    layout, train_class, eval_class: how rows become batches, where not as cfg's columns say (data=text)."""
    sources = open_sources(cfg, env.world_size)
    seen = "; ".join(f"{name}: {s.fingerprint() if s else None}" for name, s in vars(sources).items())
    _check_same_everywhere(seen, env)
    features = list(cfg.feature_columns)
    kind = _value(cfg.reader)
    transform = build_transform(cfg.transform)
    dtype = feature_dtype(cfg.feature_dtype)

    def stream(src: ParquetSource) -> _Stream:
        row_reader = src.has_unischema if kind == "auto" else kind == "make_reader"
        reader = ReaderOptions(
            row_reader=row_reader,
            pool_type=_value(cfg.reader_pool_type),
            workers_count=_workers(cfg.workers_count, src, features, row_reader),
            results_queue_size=cfg.results_queue_size,
        )
        shaped = layout or BatchLayout(tuple(features), cfg.label_column, dict(src.shapes), dtype)
        return _Stream(src, shaped, reader, transform)

    def evaluation(src: ParquetSource | None) -> ParquetEvalData | None:
        if src is None:
            return None
        segments, num_real = eval_share(src.piece_rows, env.world_size, env.rank)
        return (eval_class or ParquetEvalData)(stream(src), cfg.eval_batch_size or cfg.batch_size, segments, num_real)

    train = (train_class or ParquetTrainData)(
        stream(sources.train),
        rank=env.rank,
        world_size=env.world_size,
        batch_size=cfg.batch_size,
        seed=seed,
        shuffle_row_groups=cfg.shuffle_row_groups,
        shuffle_rows=cfg.shuffle_rows,
        pad=_value(cfg.remainder) == "pad",
        num_partitions=choose_partitions(cfg.canonical_partitions, recorded_partitions, env.world_size, cfg.batch_size),
    )
    return DataSplits(train, evaluation(sources.val), evaluation(sources.test))


def build(
    cfg: ParquetDataConfig, env: DistEnv, seed: int, recorded_partitions: int | None = None
) -> tuple[ParquetTrainData, ParquetEvalData | None]:
    """(training batches, test batches): build_splits without the validation split."""
    splits = build_splits(cfg, env, seed, recorded_partitions)
    return splits.train, splits.test  # type: ignore[return-value]
