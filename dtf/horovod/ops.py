"""Horovod's collectives on torch.distributed: init, the rank queries, allreduce, allgather,
broadcast, alltoall, reducescatter (and their grouped forms), sparse allreduce, barrier and join,
with their autograd rules and async handles, and process sets.

Each operation first agrees with the other ranks on what it is: a small descriptor (the kind of
operation, dtype, shape, root rank, reduction; or "joined") is all-gathered. Ranks that
disagree all raise the same RuntimeError, as Horovod's coordinator makes them, instead of
exchanging mismatched buffers, and a rank inside join() takes part in the others' allreduces
with the reduction's identity (zeros for a sum). Then the data moves in one torch.distributed
call. Operations must be issued in the same order on every rank: torch.distributed matches
collectives by order, where Horovod's coordinator matched them by name.

A process set is a torch.distributed group (new_group, made by every rank alike, as Horovod's
add_process_set is collective): an operation given process_set= agrees and moves its data among
the set's ranks only; the global process set is the job's own group.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dtf.dist.compat import all_gather_single
from dtf.horovod import world as world_env
from dtf.horovod.compression import Compression, Compressor


class HorovodInternalError(RuntimeError):
    """Horovod's name for a failed collective (a peer that went away)."""


class ReduceOp(enum.IntEnum):
    """Horovod's reduction values (horovod.common.basics)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Adasum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)


class _Kind(enum.IntEnum):
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    BARRIER = 5
    JOIN = 6
    REDUCESCATTER = 7


_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
# gloo moves no int16: it travels as int32 (exactly)
_WIRE = {torch.int16: torch.int32}
_HEADER = 9  # kind, dtype, ndim, first dim, row size, row shape digest, root, op, join round; then splits


@dataclass
class _State:
    world: world_env.World | None = None
    owns_group: bool = False  # init() made the process group (shutdown() ends it); else it was there
    rounds: int = 0  # negotiations so far, the same count on every rank
    pending: dict[str, Handle] = field(default_factory=dict)  # named async operations not yet synchronized
    process_sets: dict[int, ProcessSet] = field(default_factory=dict)  # the added ones, by id
    next_set_id: int = 1


_state = _State()


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Joins the job's process group (see dtf.horovod.world for how the rank and the rendezvous
    are found); a process group that is already there (dtf's function mode, a user's own
    init_process_group) is used as it is. Calling it again does nothing."""
    if comm is not None:
        raise ValueError(
            "dtf.horovod.init: comm (an MPI communicator) is not supported: dtf.horovod is built without MPI; "
            "give the ranks as process_sets=[hvd.ProcessSet([...]), ...]"
        )
    if _state.world is None:
        _join_group()
    _init_process_sets(list(process_sets or []))


def _join_group() -> None:
    if dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        local_rank = int(os.environ.get("LOCAL_RANK", rank % local_size))
        _state.world = world_env.World(
            rank, size, local_rank, local_size, rank // local_size, max(1, size // local_size), "torch.distributed"
        )
        global_process_set._bind(list(range(size)), None)
        return
    found = world_env.detect()
    world_env.export_rendezvous(found)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = float(os.environ.get("DTF_HOROVOD_TIMEOUT_S", "1800"))
    try:
        dist.init_process_group(backend, rank=found.rank, world_size=found.size, timeout=timedelta(seconds=timeout))
    except Exception as e:
        raise HorovodInternalError(
            f"dtf.horovod.init: rank {found.rank} of {found.size} ({found.launcher}) could not join the others at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} ({e})"
        ) from e
    if found.rank == 0:
        world_env.remove_rendezvous_file()
    _state.world, _state.owns_group, _state.rounds = found, True, 0
    global_process_set._bind(list(range(found.size)), None)
    # As Horovod's init: a script that never calls shutdown() leaves the group at exit, not to the
    # interpreter's teardown, which aborts a process whose gloo threads still run ("terminate
    # called without an active exception", seen under mpirun).
    atexit.register(shutdown)


def shutdown() -> None:
    """Leaves the job: ends the process group if init() made it, once every rank has come to leave
    (as Horovod's shutdown, which its ranks negotiate). A rank that leaves while a peer still
    tears down its group takes the rendezvous store with it (rank 0 holds it): the peer then
    aborts at exit ("terminate called without an active exception", seen under mpirun)."""
    if _state.owns_group and dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer that is gone already: nothing to wait for
            dist.barrier()
        dist.destroy_process_group()
    for process_set in list(_state.process_sets.values()):
        process_set._invalidate()
    _state.process_sets.clear()
    _state.world, _state.owns_group, _state.rounds = None, False, 0
    _state.pending.clear()


def is_initialized() -> bool:
    return _state.world is not None


def _world() -> world_env.World:
    if _state.world is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state.world


def size() -> int:
    return _world().size


def rank() -> int:
    return _world().rank


def local_size() -> int:
    return _world().local_size


def local_rank() -> int:
    return _world().local_rank


def cross_size() -> int:
    return _world().cross_size


def cross_rank() -> int:
    return _world().cross_rank


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's timeline traces its coordinator's cycles, which dtf.horovod does not have."""
    raise NotImplementedError(
        "dtf.horovod has no timeline (Horovod's trace of its own coordinator): trace the collectives with "
        "torch.profiler instead"
    )


def stop_timeline() -> None:
    start_timeline("")


def is_homogeneous() -> bool:
    return True


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return dist.is_initialized() and dist.get_backend() == "gloo"


def gloo_built() -> bool:
    return dist.is_gloo_available()


def nccl_built() -> int:
    """NCCL's version as Horovod reports it (e.g. 21803), or 0."""
    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return int(major * 10000 + minor * 100 + patch)


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return torch.version.hip is not None


# ---- agreeing on the operation ---------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """What every rank agreed on: the table of all ranks' descriptors."""

    kind: _Kind
    table: torch.Tensor  # [world, _HEADER + world] int64

    def rows(self, column: int) -> list[int]:
        return [int(v) for v in self.table[:, column]]

    @property
    def joined(self) -> list[int]:
        return [r for r, k in enumerate(self.rows(0)) if k == _Kind.JOIN]


def _control_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _descriptor(
    kind: _Kind,
    tensor: torch.Tensor | None,
    root: int = 0,
    op: int = 0,
    splits: list[int] | None = None,
    members: int | None = None,
) -> torch.Tensor:
    n = size() if members is None else members
    d = torch.zeros(_HEADER + n, dtype=torch.int64)
    d[0] = int(kind)
    if tensor is not None:
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"Tensor type {tensor.dtype} is not supported.")
        d[1] = _DTYPES.index(tensor.dtype)
        d[2] = tensor.dim()
        d[3] = tensor.shape[0] if tensor.dim() else 1
        d[4] = tensor[0].numel() if tensor.dim() else 1
        d[5] = hash(tuple(tensor.shape[1:])) & (2**62 - 1)  # an int tuple's hash is the same in every process
    d[6], d[7], d[8] = root, op, -1
    if splits is not None:
        d[_HEADER:] = torch.tensor(splits, dtype=torch.int64)
    return d


def _agree(
    kind: _Kind,
    tensor: torch.Tensor | None,
    root: int = 0,
    op: int = 0,
    splits: list[int] | None = None,
    process_set: ProcessSet | None = None,
) -> _Plan:
    """All-gathers this rank's descriptor among the process set's ranks; raises on every one of
    them alike if they disagree."""
    ps = process_set or global_process_set
    mine = _descriptor(kind, tensor, root, op, splits, ps.n)
    return _check(_gather_descriptors(mine, ps), kind, ps)


def _gather_descriptors(mine: torch.Tensor, process_set: ProcessSet | None = None) -> torch.Tensor:
    ps = process_set or global_process_set
    device = _control_device()
    gathered = [torch.empty_like(mine, device=device) for _ in range(ps.n)]
    try:
        dist.all_gather(gathered, mine.to(device), group=ps._group)
    except Exception as e:
        raise HorovodInternalError(f"dtf.horovod: a collective failed ({e})") from e
    if ps is global_process_set:  # join() counts the job's operations only
        _state.rounds += 1
    return torch.stack([g.cpu() for g in gathered])


def _check(table: torch.Tensor, kind: _Kind, process_set: ProcessSet | None = None) -> _Plan:
    ps = process_set or global_process_set
    plan = _Plan(kind, table)
    me = ps.me
    job = ps.ranks  # the ranks in the job, for the messages
    assert job is not None
    active = [r for r in range(ps.n) if r not in plan.joined]
    names = {k.value: k.name.lower() for k in _Kind}
    for r in active:
        row, mine = table[r], table[me]
        if row[0] != mine[0]:
            raise RuntimeError(
                f"Mismatched collective operations: rank {job[r]} called {names[int(row[0])]}, rank "
                f"{job[me]} called {names[int(mine[0])]} (issue collectives in the same order on every rank)"
            )
        if kind in (_Kind.BARRIER,):
            continue
        if row[1] != mine[1]:
            raise RuntimeError(
                f"Mismatched data types: rank {job[r]} has {_DTYPES[int(row[1])]}, rank {job[me]} has "
                f"{_DTYPES[int(mine[1])]}"
            )
        same_dims = [2, 4, 5] if kind in (_Kind.ALLGATHER, _Kind.ALLTOALL) else [2, 3, 4, 5]
        if any(row[i] != mine[i] for i in same_dims):
            raise RuntimeError(f"Mismatched {names[kind]} tensor shapes: rank {job[r]} and rank {job[me]} differ")
        if kind == _Kind.BROADCAST and row[6] != mine[6]:
            raise RuntimeError(
                f"Mismatched broadcast root ranks: rank {job[r]} uses {int(row[6])}, rank {job[me]} uses {int(mine[6])}"
            )
        if kind in (_Kind.ALLREDUCE, _Kind.REDUCESCATTER) and row[7] != mine[7]:
            raise RuntimeError(
                f"Mismatched {names[kind]} reduction operations: rank {job[r]} and rank {job[me]} differ"
            )
    if plan.joined and kind in (_Kind.ALLGATHER, _Kind.BROADCAST, _Kind.ALLTOALL, _Kind.REDUCESCATTER):
        raise RuntimeError(
            f"{names[kind]} is not possible while rank(s) {plan.joined} have joined (hvd.join): only allreduce "
            "continues past a rank's join"
        )
    return plan


# ---- handles ---------------------------------------------------------------------------------


class Handle:
    """An operation in flight: poll() it, synchronize() it for its result."""

    def __init__(self, work: Any, finish: Callable[[], Any], name: str | None) -> None:
        self._work, self._finish, self.name = work, finish, name
        self._done = False
        self._result: Any = None

    def poll(self) -> bool:
        return self._done or self._work is None or bool(self._work.is_completed())

    def wait(self) -> Any:
        if not self._done:
            try:
                if self._work is not None:
                    self._work.wait()
            except Exception as e:
                raise HorovodInternalError(f"dtf.horovod: a collective failed ({e})") from e
            self._result, self._done = self._finish(), True
            if self.name is not None:
                _state.pending.pop(self.name, None)
        return self._result


def _register(name: str | None) -> None:
    if name is not None and name in _state.pending:
        raise ValueError(f"Duplicate name '{name}': an operation of this name is still in flight on this rank")


def _named(handle: Handle) -> Handle:
    if handle.name is not None:
        _state.pending[handle.name] = handle
    return handle


def poll(handle: Handle | GroupHandle) -> bool:
    return handle.poll()


def synchronize(handle: Handle | GroupHandle) -> Any:
    return handle.wait()


# ---- allreduce -------------------------------------------------------------------------------


def _reduce_op(op: int) -> dist.ReduceOp.RedOpType:
    return {
        ReduceOp.Average: dist.ReduceOp.SUM,
        ReduceOp.Sum: dist.ReduceOp.SUM,
        ReduceOp.Min: dist.ReduceOp.MIN,
        ReduceOp.Max: dist.ReduceOp.MAX,
        ReduceOp.Product: dist.ReduceOp.PRODUCT,
    }[ReduceOp(op)]


def _resolve_op(op: int | None, average: bool | None) -> ReduceOp:
    """Horovod's rule: `average` (deprecated) or `op`, not both; Average when neither."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        op = ReduceOp.Sum if average is False else ReduceOp.Average
    if op == ReduceOp.Adasum:
        raise NotImplementedError("dtf.horovod: op=Adasum is not supported; use hvd.Average (or hvd.Sum)")
    return ReduceOp(op)


def _identity(op: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """What a joined rank contributes, so that the others' result is theirs alone."""
    if op in (ReduceOp.Average, ReduceOp.Sum):
        return torch.zeros(numel, dtype=dtype)
    if op == ReduceOp.Product:
        return torch.ones(numel, dtype=dtype)
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return torch.full((numel,), info.max if op == ReduceOp.Min else info.min, dtype=dtype)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Starts an in-place reduction of tensor over the process set's ranks (all by default);
    synchronize(handle) returns tensor."""
    ps = _member_of(process_set)
    resolved = _resolve_op(op, average)
    _register(name)
    _agree(_Kind.ALLREDUCE, tensor, op=int(resolved), process_set=ps)
    return _named(_start_allreduce(tensor, resolved, prescale_factor, postscale_factor, name, ps))


def _start_allreduce(
    tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float, name: str | None, ps: ProcessSet
) -> Handle:
    wire = _scaled(tensor, prescale).to(_WIRE.get(tensor.dtype, tensor.dtype)).contiguous()
    work = dist.all_reduce(wire, op=_reduce_op(op), group=ps._group, async_op=True)

    def finish() -> torch.Tensor:
        result = _finish_reduction(wire.to(tensor.dtype), op, postscale, ps.n)
        if result.data_ptr() != tensor.data_ptr():
            tensor.copy_(result.view_as(tensor))
        return tensor

    return Handle(work, finish, name)


def _finish_reduction(result: torch.Tensor, op: ReduceOp, postscale: float, members: int) -> torch.Tensor:
    """The postscale, then for an average the division by the set's size: correctly rounded,
    truncated for integers (as Horovod)."""
    result = _scaled(result, postscale)
    if op != ReduceOp.Average:
        return result
    exact = result.dtype.is_floating_point or result.dtype.is_complex
    return result / members if exact else torch.div(result, members, rounding_mode="trunc")


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """tensor x factor in its dtype, as Horovod scales: integers in float64, float16 in float32."""
    if factor == 1.0:
        return tensor
    if (tensor.dtype.is_floating_point and tensor.dtype.itemsize >= 4) or tensor.dtype.is_complex:
        return tensor * factor
    compute = torch.float32 if tensor.dtype.is_floating_point else torch.float64
    return (tensor.to(compute) * torch.tensor(factor, dtype=compute)).to(tensor.dtype)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle:
    """As allreduce_async_, into a new tensor: tensor is left as it is."""
    return allreduce_async_(tensor.clone(), average, name, op, prescale_factor, postscale_factor, process_set)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        op: ReduceOp,
        name: str | None,
        prescale: float,
        postscale: float,
        ps: ProcessSet,
    ) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale, ctx.ps = op, prescale, postscale, ps
        return allreduce_(
            tensor.detach().clone(),
            name=name,
            op=op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=ps,
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(
            grad, op=ctx.op, prescale_factor=ctx.prescale, postscale_factor=ctx.postscale, process_set=ctx.ps
        )
        return reduced, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """The reduction of tensor over the process set's ranks (Average by default), as a new
    tensor; tensor is left as it is. Differentiable: the gradient is reduced the same way."""
    ps = _member_of(process_set)
    resolved = _resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, resolved, name, prescale_factor, postscale_factor, ps)
    return compression.decompress(reduced, ctx)


class GroupHandle:
    """Several operations started together (a grouped_* call): synchronize() returns their
    results as a list."""

    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles

    def poll(self) -> bool:
        return all(h.poll() for h in self.handles)

    def wait(self) -> list[Any]:
        return [h.wait() for h in self.handles]


def _member_name(name: str | None, i: int) -> str | None:
    return None if name is None else f"{name}.{i}"


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> GroupHandle:
    return GroupHandle(
        [
            allreduce_async_(t, average, _member_name(name, i), op, prescale_factor, postscale_factor, process_set)
            for i, t in enumerate(tensors)
        ]
    )


def grouped_allreduce_async(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> GroupHandle:
    clones = [t.clone() for t in tensors]
    return grouped_allreduce_async_(clones, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    return [
        allreduce(t, average, _member_name(name, i), compression, op, prescale_factor, postscale_factor, process_set)
        for i, t in enumerate(tensors)
    ]


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet | None = None
) -> Callable[[], torch.Tensor]:
    """Horovod's reduction of a sparse tensor: every rank's indices and values are all-gathered,
    and calling the returned function gives the sum (op=Average: divided by the set's size) as
    a coalesced sparse tensor of tensor's shape."""
    ps = _member_of(process_set)
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"sparse_allreduce_async: op must be hvd.Average or hvd.Sum, not {ReduceOp(op).name}")
    sparse = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates along the first dimension: the indices travel as (nnz, ndim)
    indices_handle = allgather_async(sparse.indices().t().contiguous(), _member_name(name, 0), ps)
    values_handle = allgather_async(sparse.values().contiguous(), _member_name(name, 1), ps)

    def handle() -> torch.Tensor:
        values = synchronize(values_handle)
        indices = synchronize(indices_handle)
        if op == ReduceOp.Average:
            values = values / ps.n
        return torch.sparse_coo_tensor(indices.t(), values, tensor.shape).coalesce()

    return handle


# ---- allgather -------------------------------------------------------------------------------


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None) -> Handle:
    """Starts concatenating every member's tensor along the first dimension (its size may differ
    between ranks, the other dimensions may not)."""
    ps = _member_of(process_set)
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor of at least one dimension")
    _register(name)
    plan = _agree(_Kind.ALLGATHER, tensor, process_set=ps)
    firsts = plan.rows(3)
    longest = max(firsts)
    wire_dtype = _WIRE.get(tensor.dtype, tensor.dtype)
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=wire_dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    out = torch.empty((ps.n * longest, *tensor.shape[1:]), dtype=wire_dtype, device=tensor.device)
    work = all_gather_single(out, padded, group=ps._group, async_op=True)

    def finish() -> torch.Tensor:
        parts = [out[r * longest : r * longest + n] for r, n in enumerate(firsts)]
        return torch.cat(parts).to(tensor.dtype)

    return _named(Handle(work, finish, name))


def _own_rows(grad: torch.Tensor, rows: int, ps: ProcessSet) -> torch.Tensor:
    """Horovod's allgather gradient: the average over the set, this rank's rows of it."""
    reduced = allreduce(grad, op=ReduceOp.Average, process_set=ps)
    dims = allgather(torch.tensor([rows], dtype=torch.int64), process_set=ps).tolist()
    return reduced.narrow(0, sum(dims[: ps.me]), rows)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.dim, ctx.ps = tensor.shape[0], ps
        return synchronize(allgather_async(tensor.detach(), name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _own_rows(grad, ctx.dim, ctx.ps), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None) -> torch.Tensor:
    return _Allgather.apply(tensor, name, _member_of(process_set))


def grouped_allgather_async(
    tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None
) -> GroupHandle:
    return GroupHandle([allgather_async(t, _member_name(name, i), process_set) for i, t in enumerate(tensors)])


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, ps: ProcessSet, *tensors: torch.Tensor) -> Any:
        ctx.dims, ctx.ps = [t.shape[0] for t in tensors], ps
        return tuple(synchronize(grouped_allgather_async([t.detach() for t in tensors], name, ps)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, *(_own_rows(g, rows, ctx.ps) for g, rows in zip(grads, ctx.dims, strict=True)))


def grouped_allgather(
    tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None
) -> list[torch.Tensor]:
    """allgather of each tensor (the first dimensions may differ between ranks and tensors)."""
    return list(_GroupedAllgather.apply(name, _member_of(process_set), *tensors))


# ---- reducescatter ---------------------------------------------------------------------------


def _scatter_rows(rows: int, members: int) -> list[int]:
    """Horovod's split of the first dimension: equal parts, the first ranks one row more each
    while rows remain."""
    return [rows // members + (1 if r < rows % members else 0) for r in range(members)]


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = ReduceOp.Average,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Starts reducing tensor over the set's ranks (Average by default, or Sum), each keeping its
    share of the first dimension (_scatter_rows). gloo has no reduce-scatter: the reduction is
    an all_reduce of which each rank keeps its rows, the same values."""
    ps = _member_of(process_set)
    resolved = _reducescatter_op(op)
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension (it splits the first)")
    _register(name)
    _agree(_Kind.REDUCESCATTER, tensor, op=int(resolved), process_set=ps)
    return _named(_start_reducescatter(tensor, resolved, prescale_factor, postscale_factor, name, ps))


def _reducescatter_op(op: int | None) -> ReduceOp:
    if op == ReduceOp.Adasum:
        raise NotImplementedError("dtf.horovod: reducescatter with op=Adasum is not supported (nor by Horovod)")
    resolved = ReduceOp.Average if op is None else ReduceOp(op)
    if resolved not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"reducescatter: op must be hvd.Average or hvd.Sum, not hvd.{resolved.name}")
    return resolved


def _start_reducescatter(
    tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float, name: str | None, ps: ProcessSet
) -> Handle:
    wire = _scaled(tensor, prescale).to(_WIRE.get(tensor.dtype, tensor.dtype)).contiguous()
    if wire.data_ptr() == tensor.data_ptr():
        wire = wire.clone()  # the input is not modified
    work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=ps._group, async_op=True)
    shares = _scatter_rows(tensor.shape[0], ps.n)
    start = sum(shares[: ps.me])

    def finish() -> torch.Tensor:
        mine = wire.narrow(0, start, shares[ps.me]).to(tensor.dtype)
        return _finish_reduction(mine, op, postscale, ps.n).clone()

    return Handle(work, finish, name)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, ps: ProcessSet, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.ps, ctx.pre, ctx.post = op, ps, pre, post
        return synchronize(reducescatter_async(tensor.detach(), name, op, ps, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _reducescatter_grad(grad, ctx), None, None, None, None, None


def _scaled_grad(grad: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Horovod's rule for reducescatter's gradient, before it is all-gathered: for Sum x the
    set's size, then x prescale x postscale (for Average: as it is)."""
    if ctx.op == ReduceOp.Sum:
        grad = grad * ctx.ps.n
    if ctx.pre != 1.0:
        grad = grad * ctx.pre
    if ctx.post != 1.0:
        grad = grad * ctx.post
    return grad


def _reducescatter_grad(grad: torch.Tensor, ctx: Any) -> torch.Tensor:
    return allgather(_scaled_grad(grad, ctx), process_set=ctx.ps)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = ReduceOp.Average,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This rank's share (_scatter_rows) of tensor reduced over the set's ranks; tensor is left
    as it is. Differentiable, with Horovod's gradient (_scaled_grad, all-gathered)."""
    ps = _member_of(process_set)
    resolved = _reducescatter_op(op)
    compressed, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, resolved, ps, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(
    tensors: list[torch.Tensor],
    name: str | None = None,
    op: int = ReduceOp.Average,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> GroupHandle:
    for t in tensors:  # refused before any of them starts, on every rank alike
        if t.dim() == 0:
            raise ValueError("grouped_reducescatter: every tensor needs at least one dimension (it splits the first)")
    return GroupHandle(
        [
            reducescatter_async(t, _member_name(name, i), op, process_set, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)
        ]
    )


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: str | None, op: ReduceOp, ps: ProcessSet, pre: float, post: float, *tensors: torch.Tensor
    ) -> Any:
        ctx.op, ctx.ps, ctx.pre, ctx.post = op, ps, pre, post
        detached = [t.detach() for t in tensors]
        return tuple(synchronize(grouped_reducescatter_async(detached, name, op, ps, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, None, None, None, *grouped_allgather([_scaled_grad(g, ctx) for g in grads], None, ctx.ps))


def grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = ReduceOp.Average,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    ps = _member_of(process_set)
    resolved = _reducescatter_op(op)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _GroupedReducescatter.apply(name, resolved, ps, prescale_factor, postscale_factor, *(c for c, _ in pairs))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs, strict=True)]


# ---- broadcast -------------------------------------------------------------------------------


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet | None = None
) -> Handle:
    """Starts writing root_rank's tensor into tensor on every rank of the set (root_rank is a
    rank of the job, as in Horovod, and a member of the set)."""
    ps = _member_of(process_set)
    if root_rank not in ps.ranks:  # type: ignore[operator]
        raise ValueError(f"root_rank {root_rank} is not a rank of the process set {ps.ranks}")
    _register(name)
    _agree(_Kind.BROADCAST, tensor, root=root_rank, process_set=ps)
    wire = tensor if tensor.dtype not in _WIRE else tensor.to(_WIRE[tensor.dtype])
    wire = wire if wire.is_contiguous() else wire.contiguous()
    work = dist.broadcast(wire, src=root_rank, group=ps._group, async_op=True)

    def finish() -> torch.Tensor:
        if wire.data_ptr() != tensor.data_ptr():
            tensor.copy_(wire)
        return tensor

    return _named(Handle(work, finish, name))


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet | None = None
) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet | None = None
) -> Handle:
    return broadcast_async_(tensor.clone(), root_rank, name, process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.ps = root_rank, ps
        return broadcast_(tensor.detach().clone(), root_rank, name, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=ReduceOp.Average, process_set=ctx.ps)
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet | None = None
) -> torch.Tensor:
    """root_rank's tensor, as a new tensor on every rank of the set; tensor is left as it is."""
    return _Broadcast.apply(tensor, root_rank, name, _member_of(process_set))


# ---- alltoall --------------------------------------------------------------------------------


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet | None = None
) -> Handle:
    """Starts sending splits[r] rows of tensor (in set rank order) to each member r, and
    receiving theirs: synchronize() returns (the rows received, how many came from each)."""
    ps = _member_of(process_set)
    n = ps.n
    rows = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall: the first dimension ({rows}) is not a multiple of the {n} ranks; give splits")
        send = [rows // n] * n
    else:
        if isinstance(splits, torch.Tensor) and splits.dtype != torch.int32:
            raise ValueError(f"alltoall: splits must hold 32-bit integers, not {splits.dtype}")
        send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(send) != n or any(s < 0 for s in send):
            raise ValueError(f"alltoall: splits must give {n} non-negative counts, one per rank: {send}")
        if sum(send) > rows:
            raise ValueError(f"alltoall: splits add up to {sum(send)}, more than the {rows} rows of the tensor")
    _register(name)
    plan = _agree(_Kind.ALLTOALL, tensor, splits=send, process_set=ps)
    received = [int(plan.table[r, _HEADER + ps.me]) for r in range(n)]
    wire_dtype = _WIRE.get(tensor.dtype, tensor.dtype)
    source = tensor[: sum(send)].to(wire_dtype).contiguous()
    out = torch.empty((sum(received), *tensor.shape[1:]), dtype=wire_dtype, device=tensor.device)
    work = dist.all_to_all_single(
        out, source, output_split_sizes=received, input_split_sizes=send, group=ps._group, async_op=True
    )

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        return out.to(tensor.dtype), torch.tensor(received, dtype=torch.int32)

    return _named(Handle(work, finish, name))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, ps: ProcessSet) -> Any:
        output, received = synchronize(alltoall_async(tensor.detach(), splits, name, ps))
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> Any:
        back, _ = synchronize(alltoall_async(grad, ctx.received, process_set=ctx.ps))
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet | None = None
) -> Any:
    """The rows every member sent this one; with splits given, also how many came from each."""
    output, received = _Alltoall.apply(tensor, splits, name, _member_of(process_set))
    return output if splits is None else (output, received)


# ---- barrier and join ------------------------------------------------------------------------


def barrier(process_set: ProcessSet | None = None) -> None:
    """Returns once every rank of the set (all by default) has called it."""
    _agree(_Kind.BARRIER, None, process_set=_member_of(process_set))


def join(device: int = -1) -> int:
    """This rank is done with its data: until every rank has joined, it takes part in the
    others' allreduces with the reduction's identity (zeros for a sum; an average still divides
    by the whole job's size). Returns the rank that joined last, the same on every rank."""
    joined_at = _state.rounds
    while True:
        mine = _descriptor(_Kind.JOIN, None)
        mine[8] = joined_at
        table = _gather_descriptors(mine)
        kinds = [int(k) for k in table[:, 0]]
        active = [r for r, k in enumerate(kinds) if k != _Kind.JOIN]
        if not active:
            rounds = [int(v) for v in table[:, 8]]
            return max(r for r in range(size()) if rounds[r] == max(rounds))
        op = table[active[0]]
        if int(op[0]) == _Kind.ALLREDUCE:  # the others reduce: take part with the identity
            dtype = _DTYPES[int(op[1])]
            wire = _identity(int(op[7]), _WIRE.get(dtype, dtype), int(op[3]) * int(op[4])).to(_control_device())
            dist.all_reduce(wire, op=_reduce_op(int(op[7])))
        # allgather, broadcast, alltoall: the others raise (no data moves); barrier: done by the gathering


# ---- process sets ----------------------------------------------------------------------------


class ProcessSet:
    """Horovod's process set: some of the job's ranks, which run collectives among themselves
    (process_set= on every collective), carried by a torch.distributed group. ProcessSet(ranks)
    is registered by hvd.add_process_set(...) or hvd.init(process_sets=[...]), which every rank
    of the job calls alike (torch.distributed.new_group is collective, as Horovod's adding is).
    size() and rank() are None until then; rank() is this process's rank within the set."""

    def __init__(self, ranks_or_comm: Any) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: Any = None
        self._group: Any = None  # the torch.distributed group; None: the job's (WORLD)
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError(
                "ProcessSet takes a list of ranks: dtf.horovod is built without MPI, so not an MPI communicator"
            ) from None
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks: list[int] | None = ranks

    def _bind(self, ranks: list[int], group: Any) -> None:
        self.ranks, self._group = ranks, group

    def _invalidate(self) -> None:
        self.process_set_id, self._group = None, None

    @property
    def n(self) -> int:
        """The number of ranks (of a registered set)."""
        assert self.ranks is not None
        return len(self.ranks)

    @property
    def me(self) -> int:
        """This rank's place in the set (a registered set this rank is in)."""
        r = self.rank()
        assert r is not None
        return r

    def size(self) -> int | None:
        if self.process_set_id is None or self.ranks is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (None before it is registered). As in Horovod,
        collectives still name ranks by their rank in the job (broadcast's root_rank)."""
        if self.process_set_id is None or self.ranks is None:
            return None
        me = rank()
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _member_of(process_set: ProcessSet | None) -> ProcessSet:
    """The set an operation runs on (the global one by default); this rank must be in it."""
    ps = global_process_set if process_set is None else process_set
    _world()
    if not isinstance(ps, ProcessSet):
        raise ValueError(f"process_set must be a hvd.ProcessSet, not {type(ps).__name__}")
    if ps.process_set_id is None:
        raise ValueError(f"{ps} is not registered: use hvd.add_process_set(...) or hvd.init(process_sets=[...])")
    if not ps.included():
        raise ValueError(f"rank {rank()} is not in {ps}: only its ranks may run its collectives")
    return ps


def add_process_set(process_set: ProcessSet | Any) -> ProcessSet:
    """Registers a process set (a ProcessSet or a list of ranks) and returns it. Every rank of
    the job calls it, in the same order (its group is made by all of them). A set of the same
    ranks as one registered already raises ValueError, as in Horovod."""
    world = _world()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    assert ps.ranks is not None
    if not ps.ranks or any(not 0 <= r < world.size for r in ps.ranks) or len(set(ps.ranks)) != len(ps.ranks):
        raise ValueError(f"add_process_set: {ps.ranks} must be distinct ranks of this job (0..{world.size - 1})")
    taken = [global_process_set, *_state.process_sets.values()]
    if any(other.ranks == ps.ranks for other in taken):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    group = dist.new_group(ps.ranks)  # collective: every rank of the job makes it, members or not
    ps._bind(ps.ranks, group)
    ps.process_set_id = _state.next_set_id
    _state.next_set_id += 1
    _state.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set added before (every rank calls it); returns whether it did.
    The global process set stays."""
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or set_id not in _state.process_sets:
        return False
    del _state.process_sets[set_id]
    group = process_set._group
    process_set._invalidate()
    if process_set.included() and dist.is_initialized():
        dist.destroy_process_group(group)
    return True


def _init_process_sets(process_sets: list[ProcessSet]) -> None:
    """hvd.init(process_sets=[...]): registers each, in order; as in Horovod, one whose ranks
    are the job's or a set's already registered is left unregistered (process_set_id None)."""
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"hvd.init(process_sets=...) takes hvd.ProcessSet objects, not {type(ps).__name__}")
        taken = [global_process_set, *_state.process_sets.values()]
        if ps.process_set_id is not None and _state.process_sets.get(ps.process_set_id) is ps:
            continue  # init() called again with the same sets
        if any(other.ranks == ps.ranks for other in taken):
            ps._invalidate()
            continue
        add_process_set(ps)
