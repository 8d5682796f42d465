"""Who am I in the job: rank, world size, device; init and teardown of the process group.

Whoever started the ranks (torch's elastic agent, torchrun, SLURM, Spark) exports the
torchrun variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; this
module only reads them, so nothing else in dtf needs to know the launcher.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dtf.dist.network import is_loopback, listen_on, loopback_interface

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_side_group: dist.ProcessGroup | None = None  # see side_group()


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
            os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if is_loopback(address):  # every rank is on this machine: gloo too stays on loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        # torchrun shares its agent's store with the ranks (they are all its clients); otherwise
        # rank 0 hosts the group's store, as init_process_group's env:// would, but only on the
        # address the ranks are told (the store has no authentication).
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = tcp_store(address, port, world_size, rank == 0 and not agent_store, timedelta(seconds=timeout_s))
        dist.init_process_group(
            backend=pick_backend(backend, dev),
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
        if world_size > 1:
            global _side_group
            _side_group = dist.new_group(backend="gloo")
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def side_group() -> dist.ProcessGroup | None:
    """A gloo group beside the default one, for small exchanges that go on while it may be busy
    (dtf.train.control), made by init with the default group; None where init did not make the
    group (a group of one, or one made by someone else). Made there and not when first needed: a
    group made later waits in the store for every peer's address, so a node lost before its ranks
    posted theirs would hold the others until the collective timeout, instead of failing them at
    once in a collective that names it (dtf.launch.nodes.lost_node)."""
    return _side_group


def tcp_store(host: str, port: int, world_size: int | None, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """torch's TCPStore, whose server (is_master) listens only on host's address, not on every
    interface as TCPStore's own does: a socket bound there is handed to it. port 0: any free one."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, multi_tenant=True)
    try:
        listener = listen_on(host, port)
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise
        print(
            f"dtf: warning: {host} is not an address of this machine, where rank 0 hosts the process group's "
            "store: it listens on every interface",
            flush=True,
        )
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, multi_tenant=True)
    return dist.TCPStore(
        host,
        listener.getsockname()[1],
        world_size,
        is_master=True,
        timeout=timeout,
        multi_tenant=True,
        master_listen_fd=listener.detach(),
    )


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's value of a small picklable object, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def destroy() -> None:
    global _side_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _side_group = None


def free_port(host: str = "") -> int:
    """A TCP port free on host's address (default: on every interface of this host, for peers on
    other hosts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
