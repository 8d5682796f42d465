"""Who am I in the job: rank, world size, device; init and teardown of the process group.

Whoever started the ranks (torch's elastic agent, torchrun, SLURM, Spark) exports the
torchrun variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; this
module only reads them, so nothing else in dtf needs to know the launcher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def attempt_number() -> int:
    """0 on a run's first attempt; the restart count when torch elastic restarted the ranks
    (launcher.max_restarts, torchrun) or SLURM requeued the job."""
    return max(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ.get("SLURM_RESTART_COUNT", "0")))


def launched_externally() -> bool:
    """True when torchrun (or any launcher speaking its protocol) already started us as a rank."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        # One GPU per rank, pinned by local rank (Horovod's step 2).
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device)


def pick_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def init(device: str = "auto", backend: str = "auto", timeout_s: float = 1800.0) -> DistEnv:
    rank = rank_from_env()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a plain single process: a group of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group(
            backend=pick_backend(backend, dev),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's value of a small picklable object, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on every interface of this host (peers on other hosts connect to it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
