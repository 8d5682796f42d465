"""checkpoint.async_save: a process beside each rank writes its checkpoints while the rank trains.

The rank only copies its state into memory that the process shares and hands it over: the loop
is held up for that copy alone. On CPU, a state of plain tensors in dicts and lists (DDP's, ZeRO's
model) is copied into buffers made once and handed to the writer once (StateBuffers); each later
save sends only what is not a tensor (the learning rate, the parameter names), and copies only the
tensors this rank's writer writes: DCP gives each tensor that several ranks hold (DDP's replicas) to
one of them, the same ones at every save of the same state, which the writer reports after the
first (WrittenBuffers), so each of 2 DDP ranks copies about half its state (the small ones all
go to rank 0: dtf.train.save_plan). Anything else (GPU memory, DTensor shards) goes through
torch's DefaultStager, which pins on CUDA and also reuses its buffers, but deep-copies the state
and passes every buffer's file descriptor again at each save.

The tensors that only the optimizer step changes (parameters and optimizer state: the caller names
them) need not be copied before the loop goes on: a thread copies them while the next step's
forward and backward run (torch's copy releases the GIL), and the loop waits for it before that
step's optimizer step (wait_staged), as torchtitan waits for DCP's asynchronous staging. Everything
else (buffers, which a forward may change) is copied before submit returns.

The writer process then does what a synchronous save does (dtf.train.checkpoint.write_files:
the small files, DCP's shards through its own gloo group, the CRC32 of every file it wrote) and
answers with the checksums; the commit marker is written by the ranks as before, once every
rank's writer has finished.

A process, not a thread (as DCP's own `async_save(..., async_checkpointer_type=PROCESS)`): a
thread's writing and pickling holds the GIL the training loop needs, and cannot be given a lower
priority. The writer runs at the lowest priority there is (Linux's SCHED_IDLE: it gets a core only
when nothing else wants it), on one thread, so that on a machine whose cores the ranks fill it
takes only the time they leave (at niceness 10 it took about a tenth of a core from them, and
the steps it overlapped were that much slower). Its saves are not held back for long: a
rank that must wait for its writer (at the next save, or the end) leaves it its core. Unlike
DCP's process, its group meets through the rank group's own store (no new server listening
anywhere), it ignores the stop signals its rank handles (a scheduler signals every
process of a job), and it dies with its rank (a killed rank leaves no orphan writing).

The writer is forked from its rank when the rank starts (start_early: one thread, torch imported,
as launcher=local's forkserver makes ranks), a few ms; where the rank runs other threads by then,
it is spawned when the BackgroundWriter is made, and imports torch and dtf again while the first
steps run (1-2 s of CPU each).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import math
import multiprocessing
import os
import signal
import sys
import uuid
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers the reductions that pass tensors through shared memory
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from dtf.errors import UserError
from dtf.helper_process import end_with_parent, main_script_hidden
from dtf.signals import ignore_stop_signals
from dtf.train.save_plan import SmallReplicasOnOneRank


class Request(Protocol):
    """dtf.train.checkpoint's SaveRequest or CommitRequest (not imported: that module imports this one)."""

    collective: bool

    def carry_out(self, rank: int, world_size: int) -> Any: ...


_STOP = "stop"


class BackgroundWriter:
    """The rank's side: stage and send a save, ask whether it is written, take its result.
    Collective to create (every rank of the group at once): the writers' group is named by rank 0."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
        from dtf.dist.env import broadcast_from_main

        on_gpu = self._on_gpu = device.type == "cuda"
        self._buffers = StateBuffers()
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=on_gpu,
                use_shared_memory=True,  # handed to the writer without a copy
                use_async_staging=False,  # the copy is done when save returns: training may change the state
                use_non_blocking_copy=on_gpu,
            )
        )
        # The writers' keys in the rank group's store, fresh for every start of the ranks.
        prefix = f"dtf/checkpoint-writer/{broadcast_from_main(uuid.uuid4().hex)}/"
        store = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])) if world_size > 1 else None
        setup = _Setup(rank, world_size, store, prefix, timeout_s)
        early = _take_early()
        if early is not None:
            self._process, self._conn = early
            self._conn.send(setup)
        else:  # this process runs threads now (its group's): a fork of it could deadlock
            context = multiprocessing.get_context("spawn")
            self._conn, theirs = context.Pipe()
            self._process = context.Process(
                target=_serve, args=(theirs, os.getpid(), setup), name=f"dtf-checkpoint-writer-{rank}", daemon=True
            )
            with main_script_hidden():
                self._process.start()
            theirs.close()
        self._expected: deque[str] = deque()  # what was sent and not yet answered, in order
        self._replies: deque[Any] = deque()  # answers received early (done), in the same order
        self._copier = ThreadPoolExecutor(1, thread_name_prefix=f"dtf-checkpoint-staging-{rank}")
        self._staging: Future[None] | None = None  # the copy of the tensors left to copy, then the send
        self._unsent: BaseException | None = None  # why the save in flight never reached the writer
        os.register_at_fork(before=functools.partial(_copied_before_fork, weakref.ref(self)))
        # Before multiprocessing's own exit handler, which would wait for a writer that ignores SIGTERM.
        atexit.register(self.close)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def submit(self, request: Any, later: frozenset[int] = frozenset()) -> None:
        """Copies the request's state into the shared buffers and hands the save over; returns at
        once. later: the data_ptr()s of tensors that do not change before the caller's next
        wait_staged(), copied in the background until then (CPU tensors staged in StateBuffers
        only). The previous save must be finished (result taken): its buffers are overwritten."""
        self.wait_staged()
        assert "save" not in self._expected, "one save at a time"
        staged: Any = None if self._on_gpu else self._buffers.stage(request.state, later)
        if staged is None:
            staged = self._stager.stage(request.state)  # not a Future: staging is synchronous
        message = dataclasses.replace(request, state=cast(dict[str, Any], staged))
        self._expected.append("save")
        if self._buffers.left_to_copy:
            self._staging = self._copier.submit(self._copy_and_send, message)
        else:
            self._conn.send(message)

    def _copy_and_send(self, message: Any) -> None:
        """The staging thread: the tensors left to copy, then the save to the writer."""
        self._buffers.copy_the_rest()
        self._conn.send(message)

    def wait_staged(self) -> bool:
        """Waits until the save in flight, if any, is copied (the tensors named `later` may change
        from then on). Whether it had to wait. A failed copy is the save's failure (from result)."""
        staging, self._staging = self._staging, None
        if staging is None:
            return False
        waited = not staging.done()
        self._unsent = staging.exception()
        return waited

    def commit(self, request: Request) -> None:
        """Hands a commit over (rank 0): the writer writes the marker before anything sent after it."""
        self.wait_staged()
        self._conn.send(request)
        self._expected.append("commit")

    def done(self) -> bool:
        """Whether the save in flight has been written (its result is waiting)."""
        if self._staging is not None and not self._staging.done():
            return False  # not even sent
        self.wait_staged()
        if self._unsent is not None:
            return True  # its failure is waiting
        while self._expected and len(self._replies) < len(self._expected) and self._conn.poll():
            self._replies.append(self._receive())
        return "save" in list(self._expected)[: len(self._replies)]

    def result(self) -> dict[str, dict[str, Any]]:
        """Waits for the save in flight: the records (size, CRC32) of the files this rank wrote.
        Its failure is raised here."""
        return self._take("save")

    def take_commit(self) -> None:
        """Waits for the commit in flight; its failure is raised here."""
        self._take("commit")

    def _take(self, kind: str) -> Any:
        """The reply to the oldest message in flight, which must be of this kind (replies come in order)."""
        self.wait_staged()
        assert self._expected and self._expected[0] == kind, f"no {kind} is the next in flight"
        self._expected.popleft()
        if kind == "save" and self._unsent is not None:
            unsent, self._unsent = self._unsent, None
            raise unsent
        reply = self._replies.popleft() if self._replies else self._receive()
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, Written):
            self._buffers.learn(reply.buffers)
            return reply.records
        return reply

    def _receive(self) -> Any:
        try:
            return self._conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise RuntimeError(
                f"the checkpoint writer process (pid {self._process.pid}) died (exit code {self._process.exitcode})"
            ) from None

    def close(self) -> None:
        """Ends the writer (after the save in flight, if any, whose result is then dropped)."""
        atexit.unregister(self.close)
        if self._conn.closed:
            return
        self.wait_staged()
        self._copier.shutdown()
        _stop(self._process, self._conn, timeout_s=30)
        self._stager.close()


# The writer forked at this rank's start (start_early), until its BackgroundWriter takes it: the
# rank's pid (a process forked from the rank inherits this, and must not take it), the process, its pipe.
_early: tuple[int, multiprocessing.process.BaseProcess, Connection] | None = None


def start_early() -> None:
    """At a rank's start (checkpoint.async_save), while it runs one thread and has imported torch:
    forks its writer, a few ms, which waits for the rank's BackgroundWriter. One spawned when
    the BackgroundWriter is made imports torch and dtf again (1-2 s of CPU) while the first steps
    run, which made the default job's steps a third slower (docs/checkpoints.md). Elsewhere (not
    Linux, threads running, CUDA initialized: what a fork must not copy) the writer is spawned then."""
    global _early
    if _early is not None or not _may_fork():
        return
    context = multiprocessing.get_context("fork")
    conn, theirs = context.Pipe()
    name = f"dtf-checkpoint-writer-{os.environ.get('RANK', '0')}"
    process = context.Process(target=_serve, args=(theirs, os.getpid(), None), name=name, daemon=True)
    process.start()
    theirs.close()
    _early = (os.getpid(), process, conn)
    atexit.register(_drop_early)  # before multiprocessing's exit handler, as BackgroundWriter's close


def _may_fork() -> bool:
    """A fork copies one thread: another thread's locks (a pool's, the GIL-free C++ ones) would stay
    held forever in the copy. CUDA cannot be used in a fork either."""
    return sys.platform == "linux" and len(os.listdir("/proc/self/task")) == 1 and not torch.cuda.is_initialized()


def _take_early() -> tuple[multiprocessing.process.BaseProcess, Connection] | None:
    """The writer forked early, if this process forked it and it still runs."""
    global _early
    early, _early = _early, None
    if early is None or early[0] != os.getpid():
        return None
    atexit.unregister(_drop_early)
    _, process, conn = early
    if process.is_alive():
        return process, conn
    conn.close()
    return None


def _drop_early() -> None:
    """At the rank's end: a writer started early and never used is told to end (it holds this end
    of the pipe too, from the fork: it would never read an end of file)."""
    early = _take_early()
    if early is not None:
        _stop(*early, timeout_s=5)


def _stop(process: multiprocessing.process.BaseProcess, conn: Connection, timeout_s: float) -> None:
    """Tells a writer to end once it has written what it was sent; killed if it has not within timeout_s."""
    if process.is_alive():
        with contextlib.suppress(OSError):
            conn.send(_STOP)
        process.join(timeout=timeout_s)
        if process.is_alive():
            process.kill()
            process.join()
    conn.close()


def lowest_priority() -> None:
    """This process runs only when a core would otherwise be idle (SCHED_IDLE), or at niceness 19
    where there is no such policy (macOS)."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)


def _copied_before_fork(ref: weakref.ref[BackgroundWriter]) -> None:
    """A fork (a DataLoader's workers) copies this process as it is: never in the middle of a copy."""
    writer = ref()
    if writer is not None and writer._staging is not None:
        wait([writer._staging])


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What the writer needs from its rank's BackgroundWriter: where its group meets."""

    rank: int
    world_size: int
    store: tuple[str, int] | None
    prefix: str
    timeout_s: float


def _serve(conn: Connection, parent: int, setup: _Setup | None) -> None:
    """The writer process: writes each save it receives and answers with its records, and each
    commit (rank 0) with None, or with the error of either. setup: None when forked early, then
    the first message."""
    end_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the rank died before the line above
        return
    ignore_stop_signals()
    lowest_priority()
    torch.set_num_threads(1)
    if setup is None:
        try:
            setup = conn.recv()
        except EOFError:
            return
        if not isinstance(setup, _Setup):  # _STOP: the rank ends without a BackgroundWriter
            return
    rank, world_size, store = setup.rank, setup.world_size, setup.store
    joined = False
    buffers: list[torch.Tensor] = []  # StateBuffers': the rank sends them once
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the rank is gone
            return
        if isinstance(request, str) and request == _STOP:
            return
        try:
            # A save on every rank's writer at once; a commit on rank 0's, once every writer has written its part.
            if request.collective and store is not None and not joined:  # the writers' group, at the first save
                _join(rank, world_size, store, setup.prefix, setup.timeout_s)
                joined = True
            staged = getattr(request, "state", None)
            planner: WrittenBuffers | None = None
            if isinstance(staged, Staged):
                buffers = staged.buffers if staged.buffers is not None else buffers
                planner = WrittenBuffers(buffers, staged.fresh)
                request = dataclasses.replace(request, state=staged.rebuild(buffers), planner=planner)
            reply: Any = request.carry_out(rank, world_size)
            if planner is not None:
                reply = Written(reply, planner.written)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            reply = _portable(e)
        conn.send(reply)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor of the state was: the writer's buffer of this index holds its copy."""

    index: int


@dataclasses.dataclass
class Staged:
    """A state as StateBuffers hands it over: its structure with _Slots for tensors, and the
    buffers themselves when they are new (else the writer uses those it was sent before)."""

    skeleton: Any
    buffers: list[torch.Tensor] | None
    fresh: frozenset[int] | None  # the buffers copied for this save (None: all)

    def rebuild(self, buffers: list[torch.Tensor]) -> Any:
        return tree_map(lambda leaf: buffers[leaf.index] if isinstance(leaf, _Slot) else leaf, self.skeleton)


_ATOMS = (str, int, float, bool, bytes, type(None))


class StateBuffers:
    """The copy of a CPU state made for the writer, into shared-memory buffers allocated at the
    first save and reused while the state keeps its structure and shapes (a new layout gets new
    buffers). Once the writer has said which buffers it writes (learn), only those are copied."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._layout: Any = None
        self._written: frozenset[int] | None = None  # of the current buffers (None: not known yet)
        self.left_to_copy: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, tensor) for copy_the_rest

    def stage(self, state: Any, later: frozenset[int] = frozenset()) -> Staged | None:
        """state copied (None: it holds something other than plain CPU tensors in containers, and
        scalars, which DefaultStager copies instead: a tensor subclass, or an object that may hold
        tensors), but for the tensors whose data_ptr() is in `later`: those are left to
        copy_the_rest, and the staged state is complete once it has run."""
        self.left_to_copy = []
        leaves, spec = tree_flatten(state)  # one walk: the leaves, and the keys and containers
        if not all(
            (type(leaf) is torch.Tensor and leaf.device.type == "cpu") or isinstance(leaf, _ATOMS) for leaf in leaves
        ):
            return None
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        slots = iter(range(len(tensors)))
        skeleton = tree_unflatten(
            [_Slot(next(slots)) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec
        )
        # The keys too: which tensors DCP gives this rank depends on their names as well as their sizes.
        layout = (spec, [(t.shape, t.dtype) for t in tensors])
        new = layout != self._layout
        if new:
            self._buffers = _shared_buffers(layout[1])
            self._layout, self._written = layout, None
        fresh = self._written
        now: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, pair in enumerate(zip(self._buffers, tensors, strict=True)):
            if fresh is None or i in fresh:
                (self.left_to_copy if pair[1].data_ptr() in later else now).append(pair)
        _copy(now)
        return Staged(skeleton, self._buffers if new else None, fresh)

    def copy_the_rest(self) -> None:
        """The copies stage left (in any thread: torch's copy releases the GIL)."""
        left, self.left_to_copy = self.left_to_copy, []
        _copy(left)

    def learn(self, written: frozenset[int]) -> None:
        """The buffers the writer wrote at the last save: the only ones the next saves copy."""
        self._written = written


def _shared_buffers(layout: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """The copy's tensors, in shared memory (/dev/shm on Linux), which the writer process reads.
    A container's /dev/shm is often small (Docker's default: 64 MB): one line then, not torch's."""
    try:
        return [torch.empty(shape, dtype=dtype).share_memory_() for shape, dtype in layout]
    except RuntimeError as e:
        if "shared memory" not in str(e):
            raise
        needed = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout)
        free = ""
        with contextlib.suppress(OSError):
            disk = os.statvfs("/dev/shm")
            free = f", {disk.f_bavail * disk.f_frsize:,} bytes free"
        raise UserError(
            f"checkpoint.async_save=true copies this rank's state ({needed:,} bytes) into shared memory, and "
            f"/dev/shm has no room for it{free}: give it more (docker run --shm-size, a larger tmpfs), or set "
            "checkpoint.async_save=false"
        ) from None


def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():  # grad mode is each thread's own
        for buffer, tensor in pairs:
            buffer.copy_(tensor)


@dataclasses.dataclass(frozen=True)
class Written:
    """A save's reply from the writer: the records of its files, and the buffers it wrote."""

    records: dict[str, dict[str, Any]]
    buffers: frozenset[int]


class WrittenBuffers(SmallReplicasOnOneRank):
    """The rank's save planner, which also notes the shared buffers this rank writes once DCP has
    given each replicated tensor to one rank, and refuses to write one not copied for this save."""

    def __init__(self, buffers: list[torch.Tensor], fresh: frozenset[int] | None) -> None:
        super().__init__()
        self._index = {b.data_ptr(): i for i, b in enumerate(buffers) if b.numel()}  # empty ones hold nothing
        self._fresh = fresh
        self.written: frozenset[int] = frozenset()

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        written = set()
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                found = self._index.get(self.lookup_object(item.index).data_ptr())
                if found is not None:
                    written.add(found)
        if self._fresh is not None and not written <= self._fresh:
            # Never expected (the same state gets the same plan); a stale copy must not be written.
            raise RuntimeError(
                f"DCP gave this rank {len(written - self._fresh)} tensor(s) it did not copy for this save"
            )
        self.written = frozenset(written)
        return plan


def _join(rank: int, world_size: int, store: tuple[str, int], prefix: str, timeout_s: float) -> None:
    """The writers' gloo group, through the rank group's store (as a client: nothing new listens)."""
    timeout = timedelta(seconds=timeout_s)
    client = dist.TCPStore(store[0], store[1], world_size, is_master=False, timeout=timeout)
    group_store = dist.PrefixStore(prefix, client)
    dist.init_process_group("gloo", store=group_store, rank=rank, world_size=world_size, timeout=timeout)


def _portable(error: BaseException) -> BaseException:
    """error, if it survives pickling to the rank; else a RuntimeError that says what it was."""
    from multiprocessing.reduction import ForkingPickler

    try:
        ForkingPickler.loads(ForkingPickler.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
