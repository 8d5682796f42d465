"""Horovod's PyTorch API (`horovod.torch`) on torch.distributed, and sparkdl's HorovodRunner on
dtf's launchers: code written for Horovod runs with its import changed, or unchanged after
install().

    import dtf.horovod as hvd            # was: import horovod.torch as hvd
    hvd.init()                           # under dtf's launchers, torchrun, srun or mpirun
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

docs/migrating.md lists every Horovod call and what dtf.horovod offers for it (all but Adasum,
the timeline and hvd.elastic), what differs (the order of collectives), and how the tests check
it against Horovod's own.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

from dtf.horovod.compression import Compression
from dtf.horovod.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from dtf.horovod.ops import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from dtf.horovod.optimizer import DistributedOptimizer
from dtf.horovod.sync_batch_norm import SyncBatchNorm

if TYPE_CHECKING:
    from dtf.horovod.runner import HorovodRunner

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HorovodRunner",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "install",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]


def __getattr__(name: str) -> Any:
    if name == "HorovodRunner":  # imports dtf's driver side only when used
        from dtf.horovod.runner import HorovodRunner

        return HorovodRunner
    raise AttributeError(f"module 'dtf.horovod' has no attribute {name!r}")


def install() -> bool:
    """Makes `import horovod.torch as hvd` give this module, where Horovod itself is not
    installed (an installed Horovod is left alone). Returns whether the alias is in place."""
    if sys.modules.get("horovod.torch") is sys.modules[__name__]:
        return True
    if "horovod" in sys.modules or importlib.util.find_spec("horovod") is not None:
        return False
    package = types.ModuleType("horovod", "dtf.horovod standing in for Horovod (dtf.horovod.install())")
    package.__path__ = []  # a package, with nothing else to import from it
    package.torch = sys.modules[__name__]  # type: ignore[attr-defined]
    sys.modules["horovod"] = package
    sys.modules["horovod.torch"] = sys.modules[__name__]
    return True


def installed() -> bool:
    """Whether `horovod.torch` is this module in this process (install() was called)."""
    return sys.modules.get("horovod.torch") is sys.modules[__name__]
