"""Read planned row-group segments through Petastorm's reader workers, in plan order.

Petastorm's workers read row groups on a pool and hand them out as they finish, so with more
than one worker their order varies from run to run. A plan needs a fixed order: each worker
here tags what it publishes with its row group's index, and the consumer puts the row groups
back into plan order (holding at most what the pool has prefetched). Petastorm lists, opens,
decodes (Unischema codecs) and prefetches; dtf chooses which row groups, in which order, which
of their rows, and which fields: Petastorm's Reader would infer those from the first file alone
(see dtf.data.parquet.source), so the workers are started here, as the Reader starts them, with the
fields dtf found in all files.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from petastorm.arrow_reader_worker import ArrowReaderWorker
from petastorm.cache import NullCache
from petastorm.etl.dataset_metadata import load_row_groups
from petastorm.py_dict_reader_worker import PyDictReaderWorker
from petastorm.reader_impl.pickle_serializer import PickleSerializer
from petastorm.unischema import Unischema
from petastorm.workers_pool import EmptyResultError
from petastorm.workers_pool.dummy_pool import DummyPool
from petastorm.workers_pool.process_pool import ProcessPool
from petastorm.workers_pool.thread_pool import ThreadPool
from petastorm.workers_pool.ventilator import ConcurrentVentilator

from dtf.data.parquet.plan import Stream
from dtf.data.parquet.source import (
    IMAGE_FIX,
    ParquetSource,
    first_line,
    is_vector,
    open_dataset,
    quiet_petastorm,
    resolve,
)
from dtf.errors import UserError
from dtf.signals import ignore_stop_signals

Columns = dict[str, np.ndarray]

# Row groups handed to the pool beyond one per worker (as Petastorm's Reader does).
_VENTILATE_EXTRA = 2
# How often the ventilator looks whether it may hand out the next row group (Petastorm's: 10 ms,
# a pause the workers sit idle through whenever the read-ahead was full).
_VENTILATION_INTERVAL_S = 0.002


class WorkerReadError(Exception):
    """A worker's failure as one line naming the file (and the field), picklable across processes."""


def _root_cause(error: BaseException) -> BaseException:
    seen = {id(error)}
    while (nxt := error.__cause__ or error.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        error = nxt
    return error


def describe_read_error(error: BaseException, path: str, row_group: int) -> str:
    """One line: what failed in which file, the root cause, and its fix where dtf knows it."""
    field = re.match(r'Decoding field "(.+)" failed', str(error))
    root = _root_cause(error)
    what = f"decoding field {field.group(1)!r} of {path}" if field else f"reading {path} (row group {row_group})"
    line = f"{what} failed ({first_line(root)})"
    if "cv2" in str(root):  # Petastorm's image codec without OpenCV where it decodes
        line += f": Petastorm's png/jpeg codec needs OpenCV in every process that reads: {IMAGE_FIX}"
    return line


class _TagsResults:
    """Mixin for petastorm's reader workers: publishes (row group index, result) instead of the
    result alone, so the main thread can put row groups back into plan order; a failure is published
    as a WorkerReadError that names the file."""

    publish_func: Callable[[Any], None]
    _split_pieces: Sequence[Any]

    def __init__(self, worker_id: int, publish_func: Callable[[Any], None], args: Any) -> None:
        quiet_petastorm()  # also in the worker processes of reader_pool_type=process
        super().__init__(worker_id, publish_func, args)  # type: ignore[call-arg]

    def process(self, piece_index: int, worker_predicate: Any, shuffle_row_drop_partition: Any) -> None:
        publish = self.publish_func
        self.publish_func = lambda result: publish((piece_index, result))
        try:
            super().process(piece_index, worker_predicate, shuffle_row_drop_partition)  # type: ignore[misc]
        except Exception as e:
            # Published as a result, not raised: the pool would print a traceback and stop the worker.
            piece = self._split_pieces[piece_index]
            publish((piece_index, WorkerReadError(describe_read_error(e, piece.path, piece.row_group))))
        finally:
            self.publish_func = publish


class _InOwnProcess:
    """Mixin for the workers of reader_pool_type=process (constructed in their own process, not in the
    rank): they ignore the stop signals the rank handles, which a job's scheduler sends to every process."""

    def __init__(self, *args: Any) -> None:
        ignore_stop_signals()
        super().__init__(*args)


class _TaggedArrowWorker(_TagsResults, ArrowReaderWorker):
    """make_batch_reader's worker (whole row groups as Arrow tables)."""


class _TaggedPyDictWorker(_TagsResults, PyDictReaderWorker):
    """make_reader's worker (rows decoded by the Unischema's codecs)."""


class _ProcessArrowWorker(_InOwnProcess, _TaggedArrowWorker):
    pass


class _ProcessPyDictWorker(_InOwnProcess, _TaggedPyDictWorker):
    pass


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


def _start(
    pool: Any,
    source: ParquetSource,
    pieces: Sequence[int],
    columns: Sequence[str],
    opts: ReaderOptions,
    num_streams: int = 1,
) -> None:
    """What Petastorm's Reader does to start reading, with dtf's fields, row groups and order."""
    fs, path = resolve(source.url, opts.storage_options)
    dataset = open_dataset(fs, path, source.filters)
    row_groups = load_row_groups(dataset)
    listed = tuple((p.path, p.row_group) for p in row_groups)
    if listed != source.pieces:
        raise UserError(
            f"{source.key}={source.url} changed while in use ({len(listed)} row groups now, "
            f"{len(source.pieces)} when planned): do not write to a data set a run is reading"
        )
    schema = Unischema(source.unischema._name, [source.unischema.fields[c] for c in dict.fromkeys(columns)])
    items = [{"piece_index": i, "worker_predicate": None, "shuffle_row_drop_partition": (0, 1)} for i in pieces]
    ventilator = ConcurrentVentilator(
        pool.ventilate,
        items,
        iterations=1,
        # num_streams partitions read in lockstep tend to need their next row groups at the same
        # step: room for one each ahead, or the workers would wait for the consumer between them.
        max_ventilation_queue_size=pool.workers_count + _VENTILATE_EXTRA + num_streams - 1,
        ventilation_interval=_VENTILATION_INTERVAL_S,
        randomize_item_order=False,  # the plan already ordered them
    )
    worker: type = _TaggedPyDictWorker if opts.row_reader else _TaggedArrowWorker
    if opts.pool_type == "process":
        worker = _ProcessPyDictWorker if opts.row_reader else _ProcessArrowWorker
    filters = [list(c) for c in source.filters] if source.filters else None
    # The worker arguments of Petastorm's Reader: filesystem, path, schema, ngram, row groups, cache,
    # transform spec, transformed schema, filters, shuffle_rows, seed.
    pool.start(worker, (fs, path, schema, None, row_groups, NullCache(), None, schema, filters, False, 0), ventilator)


# Where a part of a step's rows is: arrays (one per column) and the rows in them (indices, or a slice).
Part = tuple[Columns, "np.ndarray | slice"]


@dataclass(frozen=True)
class _Run:
    """Rows [start, end) of stream `part` that come from one row group, `piece`."""

    part: int
    piece: int
    start: int
    end: int


class StepReading:
    """The reading of steps of one or more streams (a rank's partitions) through one pool of
    Petastorm workers. It starts when made: the workers read ahead from then on, before (and
    while) the steps are iterated, once.

    Step t takes the rows [bounds[t], bounds[t + 1]) of every stream. Every row group is read
    once, in the order it is first needed. When it arrives, the run of rows it gives the stream
    that needs it first is read out of it step by step (the row group is held until then); the
    runs it gives later (the tail of a partition whose next one starts in it, padding) are
    gathered out of it at once, so that it can be let go. So a rank holds about one row group per
    stream, plus what the pool has read ahead, and a row group that two partitions share, or that
    padding repeats, is not read twice. Runs are found once per reading, with numpy: a step costs
    a few lookups per stream, not a walk over segment objects.
    """

    def __init__(
        self,
        source: ParquetSource,
        streams: Sequence[Stream],
        bounds: Sequence[int],
        columns: Sequence[str],
        opts: ReaderOptions,
    ) -> None:
        self.source, self.streams, self.columns, self.opts = source, streams, columns, opts
        self.bounds = [int(b) for b in bounds]
        used = self.bounds[-1] if self.bounds else 0
        self.runs: list[list[_Run]] = []
        first_use: list[tuple[int, int, int]] = []  # (step, stream, run): the order row groups are needed in
        for k, stream in enumerate(streams):
            pieces = stream.pieces[:used]
            cuts = (np.flatnonzero(pieces[1:] != pieces[:-1]) + 1).tolist()
            starts, ends = [0, *cuts], [*cuts, len(pieces)]
            self.runs.append([_Run(k, int(pieces[a]), a, b) for a, b in zip(starts, ends, strict=True) if b > a])
            steps = np.searchsorted(self.bounds, starts, side="right") - 1
            first_use += [(int(t), k, j) for j, t in enumerate(steps[: len(self.runs[k])])]
        # row group -> its runs in the order of use; a row group leaves this when it arrives.
        self.pending: dict[int, list[_Run]] = {}
        for _, k, j in sorted(first_use):
            run = self.runs[k][j]
            self.pending.setdefault(run.piece, []).append(run)
        # (stream, run start) -> where the run's rows are, from its row group's arrival until used:
        # (columns, None): the row group itself, indexed by the stream's row numbers;
        # (columns, offset): rows of the run in order, position p of the stream at p - offset.
        self.sources: dict[tuple[int, int], tuple[Columns, int | None]] = {}
        self.pool: Any = None
        if self.pending:  # Petastorm publishes nothing for a row group without rows: none is planned
            quiet_petastorm()
            self.pool = _make_pool(opts)
            # Stopped when closed, or collected, or at exit at the latest: worker threads still
            # reading while the interpreter shuts down can abort it.
            self._stop = weakref.finalize(self, _stop_pool, self.pool)
            _start(self.pool, source, list(self.pending), columns, opts, num_streams=len(streams))

    @property
    def all_arrived(self) -> bool:
        """Every row group this reading needs has reached the consumer: its workers have nothing left to do."""
        return not self.pending

    def __iter__(self) -> Iterator[list[Part]]:
        arrived: dict[int, Any] = {}  # read ahead of their turn
        current = [0] * len(self.streams)  # per stream, its run at the step's first row
        for lo, hi in zip(self.bounds, self.bounds[1:], strict=False):
            parts: list[Part] = []
            for k, runs in enumerate(self.runs):
                j, at = current[k], lo
                while at < hi:
                    run = runs[j]
                    key = (k, run.start)
                    if key not in self.sources:
                        self._receive(run.piece, arrived)
                    columns, offset = self.sources[key]
                    end = min(hi, run.end)
                    rows = self.streams[k].rows[at:end] if offset is None else slice(at - offset, end - offset)
                    parts.append((columns, rows))
                    if end == run.end:  # the run is used up: let go of its rows
                        del self.sources[key]
                        j += 1
                    at = end
                current[k] = j
            yield parts
        self.close()

    def _receive(self, piece: int, arrived: dict[int, Any]) -> None:
        """Wait for a row group, keeping those that arrive before it, and place its runs' rows."""
        while piece not in arrived:
            got, payload = _next_result(self.pool, self.source, piece)
            if isinstance(payload, WorkerReadError):
                raise UserError(f"{self.source.key}={self.source.url}: {payload}")
            arrived[got] = payload
        self._place(arrived.pop(piece), self.pending.pop(piece))

    def _place(self, payload: Any, runs: list[_Run]) -> None:
        """Where the rows of one row group's runs are: the first run in the row group itself (as
        zero-copy arrays), later ones gathered out of it now (the row reader's decoded rows: every run)."""
        whole = (
            None
            if self.opts.row_reader
            else {name: arrow_to_numpy(payload.column(name), name) for name in dict.fromkeys(self.columns)}
        )
        for n, run in enumerate(runs):
            rows = self.streams[run.part].rows[run.start : run.end]
            key = run.part, run.start
            if whole is None:
                self.sources[key] = (_rows_to_columns(payload, rows, self.columns), run.start)
            elif n > 0:  # a copy: a view would hold the whole row group until this run is used
                self.sources[key] = ({name: values[rows] for name, values in whole.items()}, run.start)
            elif _is_range(rows):  # stored order: a slice of the row group, no copy
                self.sources[key] = (whole, run.start - int(rows[0]))
            else:
                self.sources[key] = (whole, None)

    def close(self) -> None:
        """Stop the workers (those of a process pool end); the reading cannot be iterated after."""
        if self.pool is not None:
            self.pool = None
            self._stop()

    @property
    def closed(self) -> bool:
        return self.pool is None


def _stop_pool(pool: Any) -> None:
    pool.stop()
    pool.join()


def assemble(parts: Sequence[Part]) -> Columns:
    """The rows of parts, in order, as one array per column: each row copied once (one part's
    contiguous rows: a view)."""
    if len(parts) == 1:
        source, rows = parts[0]
        return {name: values[rows] for name, values in source.items()}
    total = sum(_count(rows) for _, rows in parts)
    out = {}
    for name in parts[0][0]:
        dtype = np.result_type(*(source[name].dtype for source, _ in parts))
        first = parts[0][0][name]
        buffer = np.empty((total, *first.shape[1:]), dtype=dtype)
        start = 0
        for source, rows in parts:
            stop = start + _count(rows)
            values = source[name]
            if isinstance(rows, slice) or values.dtype != dtype:
                buffer[start:stop] = values[rows]
            else:
                values.take(rows, axis=0, out=buffer[start:stop], mode="clip")  # clip: unbuffered
            start = stop
        out[name] = buffer
    return out


def _count(rows: np.ndarray | slice) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def _next_result(pool: Any, source: ParquetSource, waiting_for: int) -> tuple[int, Any]:
    try:
        return pool.get_results()
    except EmptyResultError:
        raise RuntimeError(f"Petastorm returned nothing for row group {waiting_for} of {source.url}") from None
    except UserError:
        raise
    except Exception as e:  # an error of the pool itself
        path, row_group = source.pieces[waiting_for]
        raise UserError(
            f"{source.key}={source.url}: reading {path} (row group {row_group} or one before it) failed "
            f"({first_line(e)})"
        ) from None


def _is_range(rows: np.ndarray) -> bool:
    return len(rows) > 0 and int(rows[-1]) - int(rows[0]) == len(rows) - 1 and bool(np.all(np.diff(rows) == 1))


def arrow_to_numpy(column: Any, name: str) -> np.ndarray:
    """A numeric (or list-of-numbers) Arrow column as an array of shape (rows,) or (rows, width)."""
    import pyarrow as pa

    arr = column
    if isinstance(column, pa.ChunkedArray):  # a row group's column is one chunk: combine_chunks would copy it
        arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if arr.null_count:
        raise UserError(f"column {name!r} has {arr.null_count} null values: fill or drop them before training")
    if pa.types.is_dictionary(arr.type):  # a Hive partition column (root/split=train/...)
        arr = arr.dictionary_decode()
    if is_vector(arr.type):
        return vectors_to_numpy(arr, name)
    kind = arr.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        # This array's own values (it may be a slice of a longer one), without a copy: flatten()
        # copies, and numpy would read the offsets one Python object at a time.
        offsets = arr.offsets.to_numpy()
        values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        if not _is_numeric(values.type):
            raise UserError(f"column {name!r} is a list of {values.type}: dtf reads lists of numbers only")
        lengths = np.diff(offsets)
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


def vectors_to_numpy(arr: Any, name: str) -> np.ndarray:
    """Spark ML vectors (VectorUDT: dense and sparse, as VectorAssembler, StandardScaler, ... write
    them) as a float64 array of shape (rows, size), sparse ones expanded with zeros."""
    import pyarrow.compute as pc

    kind, size, indices, values = (arr.field(k) for k in ("type", "size", "indices", "values"))
    dense = kind.to_numpy(zero_copy_only=False) == 1
    lengths = pc.fill_null(pc.list_value_length(values), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    sizes = np.where(dense, lengths, pc.fill_null(size, 0).to_numpy(zero_copy_only=False))
    if len(sizes) and np.any(sizes != sizes[0]):
        raise UserError(
            f"column {name!r} holds vectors of sizes {sorted(set(sizes.tolist()))[:5]}: every row needs one size"
        )
    width = int(sizes[0]) if len(sizes) else 0
    out = np.zeros((len(arr), width), dtype=np.float64)
    flat = values.flatten().to_numpy(zero_copy_only=False)
    rows = np.repeat(np.arange(len(arr)), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    cols = np.arange(len(flat)) - starts  # a dense vector's values in order
    sparse = np.repeat(~dense, lengths)
    if sparse.any():
        picked = indices.flatten().to_numpy(zero_copy_only=False)  # dense vectors have none (null)
        if len(picked) != int(sparse.sum()) or (len(picked) and (picked.min() < 0 or picked.max() >= width)):
            raise UserError(f"column {name!r} holds sparse vectors whose indices do not match their values or size")
        cols[sparse] = picked
    out[rows, cols] = flat
    return out


def _is_numeric(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind))


def _rows_to_columns(rows_read: list[dict[str, Any]], rows: np.ndarray, columns: Sequence[str]) -> Columns:
    picked = [rows_read[i] for i in rows.tolist()]
    out = {}
    for name in columns:
        items = [row[name] for row in picked]
        try:  # decoded arrays (images, NdarrayCodec): stack copies them in one go, asarray walks them
            values = np.stack(items) if isinstance(items[0], np.ndarray) else np.asarray(items)
        except ValueError:  # arrays of different shapes
            values = np.asarray(items, dtype=object)
        if values.dtype == object:
            raise UserError(f"column {name!r} decodes to values of different shapes or types: dtf cannot batch it")
        out[name] = values
    return out
