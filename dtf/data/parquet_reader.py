"""Read planned row-group segments through Petastorm's Reader, in plan order.

Petastorm's Reader reads row groups on a pool of workers and hands them out as they finish,
so with more than one worker their order varies from run to run. A plan needs a fixed
order: each worker here tags what it publishes with its row group's index, and the
consumer puts the row groups back into plan order (holding at most what the pool has
prefetched). Petastorm also lists, opens, decodes (Unischema codecs) and prefetches;
dtf only chooses which row groups, in which order, and which of their rows.
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from petastorm.arrow_reader_worker import ArrowReaderWorker
from petastorm.cache import NullCache
from petastorm.py_dict_reader_worker import PyDictReaderWorker
from petastorm.reader import Reader
from petastorm.reader_impl.pickle_serializer import PickleSerializer
from petastorm.workers_pool import EmptyResultError
from petastorm.workers_pool.dummy_pool import DummyPool
from petastorm.workers_pool.process_pool import ProcessPool
from petastorm.workers_pool.thread_pool import ThreadPool

from dtf.data.parquet_plan import Segment
from dtf.data.parquet_source import ParquetSource, first_line, quiet_petastorm, resolve
from dtf.errors import UserError

Columns = dict[str, np.ndarray]


class _TagsResults:
    """Mixin for petastorm's reader workers: publishes (row group index, result) instead of the
    result alone, so the main thread can put row groups back into plan order."""

    publish_func: Callable[[Any], None]

    def process(self, piece_index: int, worker_predicate: Any, shuffle_row_drop_partition: Any) -> None:
        publish = self.publish_func
        self.publish_func = lambda result: publish((piece_index, result))
        try:
            super().process(piece_index, worker_predicate, shuffle_row_drop_partition)  # type: ignore[misc]
        finally:
            self.publish_func = publish


class _TaggedArrowWorker(_TagsResults, ArrowReaderWorker):
    """make_batch_reader's worker (whole row groups as Arrow tables)."""


class _TaggedPyDictWorker(_TagsResults, PyDictReaderWorker):
    """make_reader's worker (rows decoded by the Unischema's codecs)."""


class _PlannedReader(Reader):
    """Petastorm's Reader, ventilating exactly the planned row groups in plan order (a row group may repeat)."""

    def __init__(self, *args: Any, source: ParquetSource, planned_pieces: Sequence[int], **kwargs: Any) -> None:
        self._source = source
        self._planned_pieces = list(planned_pieces)
        super().__init__(*args, **kwargs)

    def _filter_row_groups(self, dataset: Any, row_groups: Any, *args: Any) -> tuple[list[int], None]:
        listed = tuple((p.path, p.row_group) for p in row_groups)
        if listed != self._source.pieces:
            raise UserError(
                f"{self._source.key}={self._source.url} changed while in use ({len(listed)} row groups now, "
                f"{len(self._source.pieces)} when planned): do not write to a data set a run is reading"
            )
        return self._planned_pieces, None


@dataclass(frozen=True)
class ReaderOptions:
    """How Petastorm reads: its reader (make_reader or make_batch_reader) and its worker pool."""

    row_reader: bool  # make_reader's decoding (Petastorm datasets), else make_batch_reader's Arrow tables
    pool_type: str = "thread"  # thread | process | dummy
    workers_count: int = 2
    results_queue_size: int = 50
    storage_options: dict[str, Any] | None = None


def _make_pool(opts: ReaderOptions) -> Any:
    if opts.pool_type == "thread":
        return ThreadPool(opts.workers_count, opts.results_queue_size)
    if opts.pool_type == "process":
        # Pickle (not Petastorm's Arrow serializer): the tagged results are (index, payload) pairs.
        return ProcessPool(opts.workers_count, PickleSerializer())
    return DummyPool()


def read_segments(
    source: ParquetSource, segments: Sequence[Segment], columns: Sequence[str], opts: ReaderOptions
) -> Iterator[Columns]:
    """The rows of each segment, in order, as one numpy array per column (dim 0: rows)."""
    segments = [s for s in segments if len(s)]  # Petastorm publishes nothing for a row group without rows
    if not segments:
        return
    quiet_petastorm()
    fs, path = resolve(source.url, opts.storage_options)
    pool = _make_pool(opts)
    reader = _PlannedReader(
        fs,
        path,
        source=source,
        planned_pieces=[s.piece for s in segments],
        # Anchored both ways, so Petastorm's old (match) and new (fullmatch) rules pick the same columns.
        schema_fields=[re.escape(c) + "$" for c in columns],
        reader_pool=pool,
        shuffle_row_groups=False,  # the plan already ordered them
        shuffle_rows=False,
        num_epochs=1,
        cache=NullCache(),
        worker_class=_TaggedPyDictWorker if opts.row_reader else _TaggedArrowWorker,
        is_batched_reader=not opts.row_reader,
    )
    pending: defaultdict[int, deque[Any]] = defaultdict(deque)
    try:
        for seg in segments:
            arrived = pending[seg.piece]
            while not arrived:
                piece, payload = _next_result(pool, source, seg.piece)
                pending[piece].append(payload)
            payload = arrived.popleft()
            yield (_rows_to_columns if opts.row_reader else _table_to_columns)(payload, seg.rows, columns)
    finally:
        reader.stop()
        reader.join()


def _next_result(pool: Any, source: ParquetSource, waiting_for: int) -> tuple[int, Any]:
    try:
        return pool.get_results()
    except EmptyResultError:
        raise RuntimeError(f"Petastorm returned nothing for row group {waiting_for} of {source.url}") from None
    except UserError:
        raise
    except Exception as e:  # a worker's read or decode error, re-raised here by the pool
        path, row_group = source.pieces[waiting_for]
        raise UserError(
            f"{source.key}={source.url}: reading {path} (row group {row_group} or one before it) failed "
            f"({first_line(e)})"
        ) from None


def _is_range(rows: np.ndarray) -> bool:
    return len(rows) > 0 and int(rows[-1]) - int(rows[0]) == len(rows) - 1 and bool(np.all(np.diff(rows) == 1))


def _table_to_columns(table: Any, rows: np.ndarray, columns: Sequence[str]) -> Columns:
    # Whole columns as zero-copy views, then one numpy gather (or a view, for a contiguous run
    # of rows): cheaper than Arrow's take on list columns followed by a copy out of Arrow.
    out = {}
    for name in columns:
        values = arrow_to_numpy(table.column(name), name)
        out[name] = values[int(rows[0]) : int(rows[0]) + len(rows)] if _is_range(rows) else values[rows]
    return out


def arrow_to_numpy(column: Any, name: str) -> np.ndarray:
    """A numeric (or list-of-numbers) Arrow column as an array of shape (rows,) or (rows, width)."""
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.null_count:
        raise UserError(f"column {name!r} has {arr.null_count} null values: fill or drop them before training")
    kind = arr.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        values = arr.flatten()
        if not _is_numeric(values.type):
            raise UserError(f"column {name!r} is a list of {values.type}: dtf reads lists of numbers only")
        lengths = np.diff(np.asarray(arr.offsets))
        if len(lengths) and np.any(lengths != lengths[0]):
            raise UserError(f"column {name!r} holds lists of different lengths: every row needs the same length")
        width = int(lengths[0]) if len(lengths) else 0
        return values.to_numpy(zero_copy_only=False).reshape(len(arr), width)
    if not _is_numeric(kind):
        # Binary columns are mostly a Petastorm codec's output (NdarrayCodec, images): only make_reader decodes them.
        hint = ", or read this Petastorm dataset with data.reader=make_reader" if pa.types.is_binary(kind) else ""
        raise UserError(
            f"column {name!r} has type {kind}: dtf turns only numbers and lists of numbers into tensors{hint}"
        )
    return arr.to_numpy(zero_copy_only=False)


def _is_numeric(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind))


def _rows_to_columns(rows_read: list[dict[str, Any]], rows: np.ndarray, columns: Sequence[str]) -> Columns:
    picked = [rows_read[i] for i in rows.tolist()]
    out = {}
    for name in columns:
        values = np.asarray([row[name] for row in picked])
        if values.dtype == object:
            raise UserError(f"column {name!r} decodes to values of different shapes or types: dtf cannot batch it")
        out[name] = values
    return out
