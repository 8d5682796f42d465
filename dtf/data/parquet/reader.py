"""Read planned rows of a Parquet data set, row group by row group, on a pool of workers.

A reading is the rows of one or more streams (a rank's partitions) in the order the plan uses
them, cut into steps. Workers (threads by default: Arrow decodes without the GIL; processes where
decoding is Python work, such as images) read whole row groups with pyarrow and turn their columns
into numpy arrays, decoding a Petastorm dataset's codecs on the way; they read in the order the
row groups are first needed, as far ahead as data.results_queue_size allows. The consumer gathers
the rows of several steps at once (a chunk) with one vectorized copy per row group and column, and
hands out each step's rows as views of that chunk: the per-step cost is a few slices, whatever the
number of partitions a step takes its rows from.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import multiprocessing
import signal
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtf.data.parquet.petastorm_format import PetastormField, decode
from dtf.data.parquet.plan import STORED, RowOrder, Stream
from dtf.data.parquet.source import IMAGE_FIX, ParquetSource, filesystem, first_line, is_vector, list_dataset
from dtf.errors import RankFault, UserError
from dtf.helper_process import main_script_hidden
from dtf.signals import ignore_stop_signals

Columns = dict[str, np.ndarray]

# A chunk of steps: enough steps that its work (a copy per run of rows and column, the
# interleaving of the partitions) is small per step, and at most a few MB (decoded), so that a
# chunk of images stays small.
CHUNK_STEPS = 256
CHUNK_BYTES = 4 << 20


class WorkerReadError(Exception):
    """A worker's failure as one line naming the file (and the field), picklable across processes."""


def describe_read_error(error: BaseException, path: str, row_group: int, column: str | None) -> str:
    """One line: what failed in which file, the root cause, and its fix where dtf knows it."""
    what = f"decoding field {column!r} of {path}" if column else f"reading {path} (row group {row_group})"
    line = f"{what} failed ({first_line(error)})"
    if isinstance(error, ImportError) and "cv2" in str(error):
        line += (
            f": png/jpeg images (Petastorm's CompressedImageCodec) need OpenCV in every process that reads: {IMAGE_FIX}"
        )
    return line


@dataclass(frozen=True)
class ReaderOptions:
    """How row groups are read: decoded by the Petastorm codecs or not, and on which worker pool."""

    row_reader: bool  # decode a Petastorm dataset's codecs (make_reader's values), else columns as stored
    pool_type: str = "thread"  # thread | process | dummy
    workers_count: int = 2
    results_queue_size: int = 8


Pieces = dict[int, Columns]  # row groups' columns, by piece


@dataclass(frozen=True)
class RowGroupReader:
    """Reads row groups' columns as numpy arrays (what a worker runs; picklable for processes)."""

    source: ParquetSource
    columns: tuple[str, ...]
    fields: Mapping[str, PetastormField]  # the columns decoded by their Petastorm codec

    def __call__(self, pieces: Sequence[int], order: RowOrder = STORED) -> Pieces:
        """These row groups' columns, the rows of each in their epoch order (order).

        A step at a time for all of them (read each, then permute and convert each): a loop that
        alternates Arrow's reading and numpy's work per row group took about 1.5 times as long
        here, each evicting the other's code and data from the CPU's caches. Permuted here rather
        than where the steps are gathered: a worker seeds and shuffles, and the consumer copies
        contiguous rows."""
        tables = {piece: self._read(piece) for piece in pieces}
        return {piece: self._columns(piece, table, order) for piece, table in tables.items()}

    def _read(self, piece: int) -> Any:
        path, row_group = self.source.pieces[piece]
        partition = self.source.partition_values.get(path, {})
        stored = [c for c in self.columns if c not in partition]
        try:
            # One thread's reads are sequential: Arrow parallelism inside them would only compete with the others'.
            table = _open(self.source, path).read_row_group(row_group, columns=stored, use_threads=False)
        except UserError:
            raise
        except Exception as e:
            raise WorkerReadError(describe_read_error(e, path, row_group, None)) from None
        start, rows = self.source.start_of(piece), self.source.piece_rows[piece]
        if start or rows != table.num_rows:  # part of the row group (a split held out for validation)
            table = table.slice(start, rows)
        return table

    def _columns(self, piece: int, table: Any, order: RowOrder) -> Columns:
        path, row_group = self.source.pieces[piece]
        partition = self.source.partition_values.get(path, {})
        perm = order.of(piece, table.num_rows) if order.shuffle else None
        out: Columns = {}
        column: str | None = None
        try:
            for column in self.columns:
                if column in partition:
                    out[column] = np.full(table.num_rows, partition[column])
                    continue
                if column in self.fields:
                    values = decode(self.fields[column], table.column(column))
                else:
                    values = arrow_to_numpy(table.column(column), column)
                out[column] = values if perm is None else values.take(perm, axis=0)
            return out
        except UserError:
            raise
        except Exception as e:
            decoding = column if column in self.fields else None
            raise WorkerReadError(describe_read_error(e, path, row_group, decoding)) from None


# Each worker thread keeps the files it read last open (their footers parsed once): a few, since
# a rank reads about one row group per partition at a time. They close when the thread ends.
_OPEN_FILES = 16
_THREAD = threading.local()


def _open(source: ParquetSource, path: str) -> Any:
    import pyarrow.parquet as pq

    files: OrderedDict[tuple[str, str], Any] = _THREAD.__dict__.setdefault("files", OrderedDict())
    key = (source.url, path)
    if key in files:
        files.move_to_end(key)
        return files[key]
    if source.cache is not None:
        opened = source.cache.open(path)
    else:
        fs, _ = filesystem(source.url, source.storage_options)
        opened = fs.open_input_file(path)
    files[key] = pq.ParquetFile(opened, metadata=source.footers.get(path))
    if len(files) > _OPEN_FILES:
        files.popitem(last=False)[1].close(force=True)
    return files[key]


_PROCESS_READER: RowGroupReader | None = None


def _start_process_worker(reader: RowGroupReader) -> None:
    """A process worker's start: it ignores the stop signals its rank handles (a scheduler signals
    every process of a job), and keeps the reader, sent once rather than with every row group."""
    global _PROCESS_READER
    ignore_stop_signals()
    _PROCESS_READER = reader


def _read_in_process(pieces: Sequence[int], order: RowOrder) -> Pieces:
    assert _PROCESS_READER is not None
    return _PROCESS_READER(pieces, order)


def _make_pool(opts: ReaderOptions, reader: RowGroupReader) -> Executor | None:
    if opts.pool_type == "thread":
        return ThreadPoolExecutor(max_workers=opts.workers_count, thread_name_prefix="dtf-parquet")
    if opts.pool_type == "process":
        # spawn: a rank has threads (gloo, torch's pools), which fork would copy in an unknown state.
        return ProcessPoolExecutor(
            max_workers=opts.workers_count,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_process_worker,
            initargs=(reader,),
        )
    return None  # dummy: read in the consumer, when a row group is needed


def _stop_pool(pool: Executor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class _Runs:
    """A stream's rows as runs of consecutive rows of one row group (in its epoch order): run j is
    the stream's rows [starts[j], starts[j + 1]), positions firsts[j], firsts[j] + 1, ... of pieces[j].
    Lists: the consumer reads them an item at a time."""

    starts: list[int]
    pieces: list[int]
    firsts: list[int]

    @staticmethod
    def of(stream: Stream) -> _Runs:
        pieces, positions = stream.pieces, stream.positions
        cuts = np.flatnonzero((pieces[1:] != pieces[:-1]) | (positions[1:] != positions[:-1] + 1)) + 1
        starts = np.concatenate([[0], cuts, [len(stream)]]).astype(np.int64) if len(stream) else np.zeros(1, np.int64)
        return _Runs(starts.tolist(), pieces[starts[:-1]].tolist(), positions[starts[:-1]].tolist())


class StepReading:
    """The reading of steps of one or more streams (a rank's partitions). It starts when made: the
    workers read ahead from then on, before (and while) the steps are iterated, once.

    Step t takes the rows [bounds[t], bounds[t + 1]) of every stream, concatenated in stream order.
    Several streams take the same number of rows every step (a rank's partitions); one stream may
    take any (evaluation batches, the last one short). Every row group is read once, in the order
    it is first needed, and let go after the chunk of steps that needs it last: a rank holds about
    one row group per stream, the chunk being handed out, and what the workers read ahead.
    """

    def __init__(
        self,
        source: ParquetSource,
        streams: Sequence[Stream],
        bounds: Sequence[int] | np.ndarray,
        columns: Sequence[str],
        opts: ReaderOptions,
    ) -> None:
        self.source, self.opts = source, opts
        self.columns = tuple(dict.fromkeys(columns))
        self.bounds = np.asarray(bounds, dtype=np.int64) if len(bounds) else np.zeros(1, np.int64)
        self.steps = len(self.bounds) - 1
        used = int(self.bounds[-1])
        self.streams = [s[:used] for s in streams] if self.steps else []
        orders = {s.order for s in self.streams}
        assert len(orders) <= 1, "the streams of a reading are of one epoch"
        self.row_order = orders.pop() if orders else STORED
        widths = np.diff(self.bounds)
        assert len(self.streams) <= 1 or np.all(widths == widths[0]), "partitions take equal rows every step"
        self.runs = [_Runs.of(s) for s in self.streams]
        # Row groups in the order they are first needed (by step, then stream), and the step that needs each last.
        first: dict[int, tuple[int, int]] = {}
        self.last_step: dict[int, int] = {}
        for k, runs in enumerate(self.runs):
            starts = np.asarray(runs.starts, dtype=np.int64)
            begins = np.searchsorted(self.bounds, starts[:-1], side="right") - 1
            ends = np.searchsorted(self.bounds, starts[1:] - 1, side="right") - 1
            for piece, begin, end in zip(runs.pieces, begins.tolist(), ends.tolist(), strict=True):
                first[piece] = min(first.get(piece, (begin, k)), (begin, k))
                self.last_step[piece] = max(self.last_step.get(piece, end), end)
        self.order = sorted(first, key=first.__getitem__)
        self.position = {piece: i for i, piece in enumerate(self.order)}
        self.row_bytes = _stored_row_bytes(source)  # until a row group arrives and says it decoded
        # Row groups are read a task of a few at a time (see RowGroupReader): each worker's share
        # of the read-ahead, a few MB at most; one at a time by processes, whose work is decoding.
        self.ahead = max(opts.results_queue_size, opts.workers_count)
        piece_bytes = self.row_bytes * max(1, source.num_rows // max(1, len(source.pieces)))
        size = 1 if opts.pool_type == "process" else min(self.ahead // opts.workers_count, CHUNK_BYTES // piece_bytes)
        self.task_size = max(1, size)
        self.tasks = [self.order[i : i + self.task_size] for i in range(0, len(self.order), self.task_size)]
        self.arrived: dict[int, Columns] = {}  # row groups at the consumer, until the chunk that needs them last
        self.futures: dict[int, Future[Pieces]] = {}  # by task
        self.next_submit = 0  # the next task to hand a worker
        self.received = 0
        fields = source.unischema.fields if opts.row_reader and source.unischema is not None else {}
        self.reader = RowGroupReader(source, self.columns, {c: fields[c] for c in self.columns if c in fields})
        self.pool: Executor | None = None
        self.workers: dict[int, multiprocessing.process.BaseProcess] = {}  # a process pool's, by pid
        self._closed = False
        # The remote listing again, unless every file this reading needs is in data.cache_dir: then
        # it reads the copies the run started with, and nothing remote.
        if self.order and not (source.cache and source.cache.holds({source.pieces[p][0] for p in self.order})):
            _check_unchanged(source)
        if self.order and source.cache is not None:
            source.cache.prefetch(source.pieces[p][0] for p in self.order)
        if self.order and opts.pool_type != "dummy":
            self.pool = _make_pool(opts, self.reader)
            assert self.pool is not None
            # Stopped when closed, or collected, or at exit at the latest.
            self._stop = weakref.finalize(self, _stop_pool, self.pool)
            self._submit(upto=0)

    @property
    def all_arrived(self) -> bool:
        """Every row group this reading needs has reached the consumer: its workers have nothing left to do."""
        return self.received == len(self.order)

    def _submit(self, upto: int) -> None:
        """Hand workers the tasks up to the one of order[upto], and as many beyond as may be read ahead."""
        limit = min(len(self.order), max(upto + 1, self.received + self.ahead))
        pool = self.pool
        assert pool is not None
        processes = self.opts.pool_type == "process"
        with main_script_hidden() if processes else contextlib.nullcontext():  # a submit may start a worker
            while self.next_submit * self.task_size < limit:
                read = _read_in_process if processes else self.reader
                try:
                    self.futures[self.next_submit] = pool.submit(read, self.tasks[self.next_submit], self.row_order)
                except BrokenProcessPool:
                    raise self._worker_died() from None
                self.next_submit += 1
                if processes:  # kept, to tell how one died: the pool forgets them when it breaks
                    self.workers.update(getattr(pool, "_processes", None) or {})

    def _receive(self, piece: int) -> Columns:
        if piece in self.arrived:
            return self.arrived[piece]
        task = self.position[piece] // self.task_size
        if self.pool is None:
            self._arrive(self._result(task, None))
            return self.arrived[piece]
        self._submit(upto=self.position[piece])
        future = self.futures.pop(task)
        # The consumer reads a task no worker thread has started rather than wait idle: the one it
        # needs, or while a worker reads that one, the next ones. (A thread that needs the GIL back
        # between Arrow's calls gets it only every few ms while the consumer runs Python, and
        # Arrow's decoding and numpy's copies release it: two readers where rows are wide.)
        if self.opts.pool_type == "thread":
            if future.cancel():
                self._arrive(self._result(task, None))
                return self.arrived[piece]
            while not future.done() and (later := self._unstarted()) is not None:
                self._arrive(self._result(later, None))
        self._arrive(self._result(task, future))
        return self.arrived[piece]

    def _unstarted(self) -> int | None:
        """The first task handed to the workers that none has started, taken back (None: none is left)."""
        for task, future in self.futures.items():
            if future.cancel():
                del self.futures[task]
                return task
        return None

    def _arrive(self, pieces: Pieces) -> None:
        self.arrived.update(pieces)
        self.received += len(pieces)
        for columns in pieces.values():
            rows = len(next(iter(columns.values()))) if columns else 0
            if rows:
                self.row_bytes = max(1, sum(v.nbytes for v in columns.values()) // rows)

    def _result(self, task: int, future: Future[Pieces] | None) -> Pieces:
        try:
            return self.reader(self.tasks[task], self.row_order) if future is None else future.result()
        except WorkerReadError as e:
            raise UserError(f"{self.source.key}={self.source.url}: {e}") from None
        except UserError:
            raise
        except BrokenProcessPool:
            raise self._worker_died() from None
        except Exception as e:  # the pool itself failed
            path, row_group = self.source.pieces[self.tasks[task][0]]
            raise UserError(
                f"{self.source.key}={self.source.url}: reading {path} (row group {row_group}) failed ({first_line(e)})"
            ) from None

    def _worker_died(self) -> RankFault:
        """A worker process of the pool died (it was killed: the kernel's OOM killer, a user's
        kill): one line saying which and how, and the ways out."""
        pid, how = _death_of(self.workers)
        return RankFault(
            f"the data reader's worker process{f' {pid}' if pid else ''} died ({how}) while it read "
            f"{self.source.key}={self.source.url}: give the rank more memory, or lower data.workers_count or "
            "data.results_queue_size, or read in threads (data.reader_pool_type=thread)"
        )

    def chunks(self) -> Iterator[tuple[Columns, list[int]]]:
        """The steps a chunk at a time: the chunk's rows, one array per column, and the number of
        rows of each step (the chunk's first rows are the first step's, and so on)."""
        first, n = 0, len(self.streams)
        try:
            while first < self.steps:
                last = min(self.steps, first + self._chunk_steps(first))
                chunk = self._gather(first, last)
                sizes = (np.diff(self.bounds[first : last + 1]) * n).tolist()
                for piece in [p for p in self.arrived if self.last_step[p] < last]:
                    del self.arrived[piece]
                yield chunk, sizes
                first = last
        finally:
            self.close()

    def _chunk_steps(self, step: int) -> int:
        rows = max(1, int(self.bounds[step + 1] - self.bounds[step]) * len(self.streams))
        return max(1, min(CHUNK_STEPS, CHUNK_BYTES // max(1, rows * self.row_bytes)))

    def _gather(self, first: int, last: int) -> Columns:
        """The rows of steps [first, last), one array per column, in step order: each stream's rows
        are copied out of their row groups a run at a time, straight to their places (several
        streams: as an array (steps, streams, rows per step, ...), step t's rows of every stream
        side by side)."""
        lo, hi = int(self.bounds[first]), int(self.bounds[last])
        n = len(self.runs)
        b = (hi - lo) // (last - first)  # several streams: every step takes b rows of each
        lead = (hi - lo,) if n == 1 else (last - first, n, b)
        chunk: dict[str, np.ndarray] = {}
        for k, runs in enumerate(self.runs):
            j = bisect.bisect_right(runs.starts, lo) - 1
            at = lo
            while at < hi:
                end = min(hi, runs.starts[j + 1])
                values = self._receive(runs.pieces[j])
                offset = runs.firsts[j] + at - runs.starts[j]
                rows = slice(offset, offset + end - at)
                if n == 1 and at == lo and end == hi:  # the chunk is one run: a view, no copy
                    chunk.update((name, column[rows]) for name, column in values.items())
                else:
                    for name, column in values.items():
                        out = chunk.get(name)
                        if out is None or out.dtype != column.dtype or out.shape[len(lead) :] != column.shape[1:]:
                            out = chunk[name] = _array_for(out, column, lead, name, self.source.pieces[runs.pieces[j]])
                        if n == 1:
                            out[at - lo : end - lo] = column[rows]
                        else:
                            _place(out, k, at - lo, end - lo, column[rows])
                at, j = end, j + 1
        return {name: out.reshape(n * (hi - lo), *out.shape[len(lead) :]) for name, out in chunk.items()}

    def stop_workers(self) -> None:
        """Stop the workers (those of a process pool end) once every row group has arrived: the
        steps still to come are made from what arrived."""
        assert self.all_arrived, "a reading needs its workers until every row group has arrived"
        if self.pool is not None:
            self.pool = None
            self._stop()

    def close(self) -> None:
        """Stop the workers (those of a process pool end); the reading cannot be iterated after."""
        if self._closed:
            return
        self._closed = True
        self.arrived.clear()
        if self.pool is not None:
            self.pool = None
            self._stop()

    @property
    def closed(self) -> bool:
        return self._closed


def _death_of(workers: Mapping[int, multiprocessing.process.BaseProcess]) -> tuple[int | None, str]:
    """(pid, how it ended) of the worker whose death broke the pool. The others do not die of
    the SIGTERM the pool sends them (they ignore it, _start_process_worker) and end cleanly; the
    one that died may not be reaped yet, so a moment is given."""
    deadline = time.monotonic() + 2.0
    while True:
        ended = {pid: p.exitcode for pid, p in workers.items() if p.exitcode not in (None, 0)}
        if ended or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if not ended:
        return None, "it ended abruptly"
    pid, code = min(ended.items(), key=lambda item: item[1] == -signal.SIGTERM)
    assert code is not None
    if code > 0:
        return pid, f"it exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL:
        return pid, f"killed by signal {name}; the kernel's OOM killer sends it when memory runs out"
    return pid, f"killed by signal {name}"


def _place(out: np.ndarray, k: int, begin: int, end: int, rows: np.ndarray) -> None:
    """Rows [begin, end) of stream k in a chunk of steps (rows) into out (steps, streams, b, ...):
    a partial step, whole steps, a partial step."""
    b = out.shape[2]
    done = 0
    if begin % b:
        take = min(b - begin % b, end - begin)
        out[begin // b, k, begin % b : begin % b + take] = rows[:take]
        begin, done = begin + take, take
    whole = (end - begin) // b
    if whole:
        out[begin // b : begin // b + whole, k] = rows[done : done + whole * b].reshape(whole, b, *rows.shape[1:])
        begin, done = begin + whole * b, done + whole * b
    if begin < end:
        out[begin // b, k, : end - begin] = rows[done:]


def _stored_row_bytes(source: ParquetSource) -> int:
    """Bytes per row as stored (uncompressed), a first guess at the decoded size."""
    rows = sum(source.piece_rows)
    stored = sum(
        meta.row_group(g).total_byte_size for meta in source.footers.values() for g in range(meta.num_row_groups)
    )
    return max(1, stored // rows) if rows else 1


def _array_for(
    have: np.ndarray | None, values: np.ndarray, lead: tuple[int, ...], name: str, piece: tuple[str, int]
) -> np.ndarray:
    """A chunk's array of a column that values fit in: made for them (first row group), the one it
    has (values cast to it on the way), or that one widened: files may store one column in
    different widths (int32 in one, int64 in another). piece: the (file, row group) of values.
    (Lists of other lengths in another file are refused from the footers before a reading.)"""
    if have is None:
        return np.empty((*lead, *values.shape[1:]), dtype=values.dtype)
    if have.shape[len(lead) :] != values.shape[1:]:
        path, row_group = piece
        raise UserError(
            f"column {name!r} holds values of shape {values.shape[1:]} in {path} (row group {row_group}) but "
            f"{have.shape[len(lead) :]} in the row groups read before it: every row needs one shape; rewrite "
            "the files that disagree with one shape"
        )
    if np.can_cast(values.dtype, have.dtype):
        return have
    return have.astype(np.result_type(have.dtype, values.dtype))


def _check_unchanged(source: ParquetSource) -> None:
    """The files of a data set must stay those it was planned from: a reading starts by listing them again."""
    fs, root = filesystem(source.url, source.storage_options)
    try:
        files = {f.path for f in list_dataset(fs, root).get_fragments()}
    except Exception as e:
        raise UserError(f"{source.key}={source.url} cannot be listed any more ({first_line(e)})") from None
    planned = set(source.files)
    if not planned <= files or (source.filters is None and files != planned):
        gone = sorted(planned - files)
        what = f"{gone[0]} is gone" if gone else f"{len(files - planned)} files were added"
        raise UserError(
            f"{source.key}={source.url} changed while in use ({what}): do not write to a data set a run is reading"
        )


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
        values = arr.values
        if offsets[0] != 0 or offsets[-1] != len(values):
            values = values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        if not _is_numeric(values.type):
            raise UserError(f"column {name!r} is a list of {values.type}: dtf reads lists of numbers only")
        width = int(offsets[1] - offsets[0]) if len(offsets) > 1 else 0
        if not _equal_lengths(offsets, width):
            raise UserError(f"column {name!r} holds lists of different lengths: every row needs the same length")
        return values.to_numpy(zero_copy_only=False).reshape(len(arr), width)
    if not _is_numeric(kind):
        # Binary columns are mostly a Petastorm codec's output (NdarrayCodec, images): only make_reader decodes them.
        hint = ", or read this Petastorm dataset with data.reader=make_reader" if pa.types.is_binary(kind) else ""
        raise UserError(
            f"column {name!r} has type {kind}: dtf turns only numbers and lists of numbers into tensors{hint}"
        )
    return arr.to_numpy(zero_copy_only=False)


def _equal_lengths(offsets: np.ndarray, width: int) -> bool:
    """Every list of these offsets holds width values."""
    if offsets[0] == 0:  # a whole row group's column: one comparison of bytes (numpy's ufuncs take longer)
        return offsets.tobytes() == _even_offsets(len(offsets), width, offsets.dtype.str)
    return not (offsets[1:] - offsets[:-1] != width).any()


@functools.lru_cache(maxsize=16)
def _even_offsets(count: int, width: int, dtype: str) -> bytes:
    return (np.arange(count, dtype=dtype) * width).tobytes()


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
