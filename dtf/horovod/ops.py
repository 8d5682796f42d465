"""Horovod's collectives on torch.distributed: init, the rank queries, allreduce, allgather,
broadcast, alltoall, barrier and join, with their autograd rules and async handles.

Each operation first agrees with the other ranks on what it is: a small descriptor (the kind of
operation, dtype, shape, root rank, reduction; or "joined") is all-gathered. Ranks that
disagree all raise the same RuntimeError, as Horovod's coordinator makes them, instead of
exchanging mismatched buffers, and a rank inside join() takes part in the others' allreduces
with the reduction's identity (zeros for a sum). Then the data moves in one torch.distributed
call. Operations must be issued in the same order on every rank: torch.distributed matches
collectives by order, where Horovod's coordinator matched them by name.
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


_state = _State()


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Joins the job's process group (see dtf.horovod.world for how the rank and the rendezvous
    are found); a process group that is already there (dtf's function mode, a user's own
    init_process_group) is used as it is. Calling it again does nothing."""
    if comm is not None or process_sets is not None:
        raise ValueError("dtf.horovod.init: comm and process_sets are not supported (one global process set)")
    if _state.world is not None:
        return
    if dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        local_rank = int(os.environ.get("LOCAL_RANK", rank % local_size))
        _state.world = world_env.World(
            rank, size, local_rank, local_size, rank // local_size, max(1, size // local_size), "torch.distributed"
        )
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
    kind: _Kind, tensor: torch.Tensor | None, root: int = 0, op: int = 0, splits: list[int] | None = None
) -> torch.Tensor:
    n = size()
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
    kind: _Kind, tensor: torch.Tensor | None, root: int = 0, op: int = 0, splits: list[int] | None = None
) -> _Plan:
    """All-gathers this rank's descriptor; raises on every rank alike if the ranks disagree."""
    return _check(_gather_descriptors(_descriptor(kind, tensor, root, op, splits)), kind)


def _gather_descriptors(mine: torch.Tensor) -> torch.Tensor:
    device = _control_device()
    gathered = [torch.empty_like(mine, device=device) for _ in range(size())]
    try:
        dist.all_gather(gathered, mine.to(device))
    except Exception as e:
        raise HorovodInternalError(f"dtf.horovod: a collective failed ({e})") from e
    _state.rounds += 1
    return torch.stack([g.cpu() for g in gathered])


def _check(table: torch.Tensor, kind: _Kind) -> _Plan:
    plan = _Plan(kind, table)
    me = rank()
    active = [r for r in range(size()) if r not in plan.joined]
    names = {k.value: k.name.lower() for k in _Kind}
    for r in active:
        row, mine = table[r], table[me]
        if row[0] != mine[0]:
            raise RuntimeError(
                f"Mismatched collective operations: rank {r} called {names[int(row[0])]}, rank {me} called "
                f"{names[int(mine[0])]} (issue collectives in the same order on every rank)"
            )
        if kind in (_Kind.BARRIER,):
            continue
        if row[1] != mine[1]:
            raise RuntimeError(
                f"Mismatched data types: rank {r} has {_DTYPES[int(row[1])]}, rank {me} has {_DTYPES[int(mine[1])]}"
            )
        same_dims = [2, 4, 5] if kind in (_Kind.ALLGATHER, _Kind.ALLTOALL) else [2, 3, 4, 5]
        if any(row[i] != mine[i] for i in same_dims):
            raise RuntimeError(f"Mismatched {names[kind]} tensor shapes: rank {r} and rank {me} differ")
        if kind == _Kind.BROADCAST and row[6] != mine[6]:
            raise RuntimeError(
                f"Mismatched broadcast root ranks: rank {r} uses {int(row[6])}, rank {me} uses {int(mine[6])}"
            )
        if kind == _Kind.ALLREDUCE and row[7] != mine[7]:
            raise RuntimeError(f"Mismatched allreduce reduction operations: rank {r} and rank {me} differ")
    if plan.joined and kind in (_Kind.ALLGATHER, _Kind.BROADCAST, _Kind.ALLTOALL):
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


def poll(handle: Handle) -> bool:
    return handle.poll()


def synchronize(handle: Handle) -> Any:
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
    process_set: Any = None,
) -> Handle:
    """Starts an in-place reduction of tensor over all ranks; synchronize(handle) returns tensor."""
    _no_process_sets(process_set)
    resolved = _resolve_op(op, average)
    _register(name)
    _agree(_Kind.ALLREDUCE, tensor, op=int(resolved))
    return _named(_start_allreduce(tensor, resolved, prescale_factor, postscale_factor, name))


def _start_allreduce(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float, name: str | None) -> Handle:
    wire = _scaled(tensor, prescale).to(_WIRE.get(tensor.dtype, tensor.dtype)).contiguous()
    work = dist.all_reduce(wire, op=_reduce_op(op), async_op=True)

    def finish() -> torch.Tensor:
        result = wire.to(tensor.dtype)
        if op == ReduceOp.Average:  # the sum divided by the size: correctly rounded, truncated for integers
            exact = result.dtype.is_floating_point or result.dtype.is_complex
            result = _scaled(result, postscale)
            result = result / size() if exact else torch.div(result, size(), rounding_mode="trunc")
        else:
            result = _scaled(result, postscale)
        if result.data_ptr() != tensor.data_ptr():
            tensor.copy_(result.view_as(tensor))
        return tensor

    return Handle(work, finish, name)


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
    process_set: Any = None,
) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """As allreduce_async_, into a new tensor: tensor is left as it is."""
    return allreduce_async_(tensor.clone(), average, name, op, prescale_factor, postscale_factor, process_set)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, name: str | None, prescale: float, postscale: float
    ) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return allreduce_(
            tensor.detach().clone(), name=name, op=op, prescale_factor=prescale, postscale_factor=postscale
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=ctx.op, prescale_factor=ctx.prescale, postscale_factor=ctx.postscale)
        return reduced, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """The reduction of tensor over all ranks (Average by default), as a new tensor; tensor is
    left as it is. Differentiable: the gradient is reduced the same way."""
    _no_process_sets(process_set)
    resolved = _resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, resolved, name, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    return [
        allreduce(
            t,
            average,
            None if name is None else f"{name}.{i}",
            compression,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )
        for i, t in enumerate(tensors)
    ]


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    handles = [
        allreduce_async_(
            t, average, None if name is None else f"{name}.{i}", op, prescale_factor, postscale_factor, process_set
        )
        for i, t in enumerate(tensors)
    ]
    return [synchronize(h) for h in handles]


# ---- allgather -------------------------------------------------------------------------------


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> Handle:
    """Starts concatenating every rank's tensor along the first dimension (its size may differ
    between ranks, the other dimensions may not)."""
    _no_process_sets(process_set)
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor of at least one dimension")
    _register(name)
    plan = _agree(_Kind.ALLGATHER, tensor)
    firsts = plan.rows(3)
    longest = max(firsts)
    wire_dtype = _WIRE.get(tensor.dtype, tensor.dtype)
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=wire_dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    out = torch.empty((size() * longest, *tensor.shape[1:]), dtype=wire_dtype, device=tensor.device)
    work = all_gather_single(out, padded, async_op=True)

    def finish() -> torch.Tensor:
        parts = [out[r * longest : r * longest + n] for r, n in enumerate(firsts)]
        return torch.cat(parts).to(tensor.dtype)

    return _named(Handle(work, finish, name))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        ctx.dim = tensor.shape[0]
        return synchronize(allgather_async(tensor.detach(), name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Horovod's rule: the averaged gradient, this rank's rows
        reduced = allreduce(grad, op=ReduceOp.Average)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int64)).tolist()
        offset = sum(dims[: rank()])
        return reduced.narrow(0, offset, ctx.dim), None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    _no_process_sets(process_set)
    return _Allgather.apply(tensor, name)


# ---- broadcast -------------------------------------------------------------------------------


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> Handle:
    """Starts writing root_rank's tensor into tensor on every rank."""
    _no_process_sets(process_set)
    if not 0 <= root_rank < size():
        raise ValueError(f"root_rank {root_rank} is not a rank of this job (0..{size() - 1})")
    _register(name)
    _agree(_Kind.BROADCAST, tensor, root=root_rank)
    wire = tensor if tensor.dtype not in _WIRE else tensor.to(_WIRE[tensor.dtype])
    wire = wire if wire.is_contiguous() else wire.contiguous()
    work = dist.broadcast(wire, src=root_rank, async_op=True)

    def finish() -> torch.Tensor:
        if wire.data_ptr() != tensor.data_ptr():
            tensor.copy_(wire)
        return tensor

    return _named(Handle(work, finish, name))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> Handle:
    return broadcast_async_(tensor.clone(), root_rank, name, process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
        ctx.root_rank = root_rank
        return broadcast_(tensor.detach().clone(), root_rank, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=ReduceOp.Average)
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """root_rank's tensor, as a new tensor on every rank; tensor is left as it is."""
    _no_process_sets(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


# ---- alltoall --------------------------------------------------------------------------------


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None
) -> Handle:
    """Starts sending splits[r] rows of tensor (in rank order) to each rank r, and receiving
    theirs: synchronize() returns (the rows received, how many came from each rank)."""
    _no_process_sets(process_set)
    n = size()
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
    plan = _agree(_Kind.ALLTOALL, tensor, splits=send)
    received = [int(plan.table[r, _HEADER + rank()]) for r in range(n)]
    wire_dtype = _WIRE.get(tensor.dtype, tensor.dtype)
    source = tensor[: sum(send)].to(wire_dtype).contiguous()
    out = torch.empty((sum(received), *tensor.shape[1:]), dtype=wire_dtype, device=tensor.device)
    work = dist.all_to_all_single(out, source, output_split_sizes=received, input_split_sizes=send, async_op=True)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        return out.to(tensor.dtype), torch.tensor(received, dtype=torch.int32)

    return _named(Handle(work, finish, name))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None) -> Any:
        output, received = synchronize(alltoall_async(tensor.detach(), splits, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> Any:
        back, _ = synchronize(alltoall_async(grad, ctx.received))
        return back, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> Any:
    """The rows every rank sent this one; with splits given, also how many came from each rank."""
    _no_process_sets(process_set)
    output, received = _Alltoall.apply(tensor, splits, name)
    return output if splits is None else (output, received)


# ---- barrier and join ------------------------------------------------------------------------


def barrier(process_set: Any = None) -> None:
    """Returns once every rank has called it."""
    _no_process_sets(process_set)
    _agree(_Kind.BARRIER, None)


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


def _no_process_sets(process_set: Any) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("dtf.horovod supports the global process set only")


class ProcessSet:
    """Horovod's global process set (the only one dtf.horovod has)."""

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True


global_process_set = ProcessSet()


def add_process_set(ranks: Any) -> ProcessSet:
    raise NotImplementedError(
        "dtf.horovod supports the global process set only: for groups of ranks use torch.distributed.new_group"
    )
