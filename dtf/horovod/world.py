"""Who this process is in a Horovod-style job, whoever started it, and where the ranks meet.

hvd.init() reads the launcher's variables and exports torchrun's (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) for torch.distributed's env:// rendezvous:

- dtf's launchers, torchrun, TorchDistributor: torchrun's variables are there already.
- `srun`: SLURM's (SLURM_PROCID, ...), read by submitit as dtf's SLURM launcher reads them; the
  rendezvous is the step's first node, on a port derived from the job and step ids.
- Open MPI's `mpirun`: OMPI_COMM_WORLD_*. mpirun offers no key-value store, and its variables name
  neither the nodes nor rank 0's host. MASTER_ADDR/MASTER_PORT given with `mpirun -x` win. Else
  rank 0 binds a port the system says is free and writes "address:port" to a file the others
  read: on one node in Open MPI's own session directory for the job (node-local, unique per
  job, removed by mpirun), on several in the working directory mpirun started in (clusters share
  it), with rank 0's address on its route to mpirun's host, which every node reaches. A port
  derived from the job id alone could be taken, and would still not say where rank 0 is.
- none of these: a job of one process.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

RENDEZVOUS_TIMEOUT_S = 120.0
# Open MPI's variables (MCA parameters keep their lowercase names)
_OMPI_JOB_ID = "OMPI_MCA_ess_base_jobid"
_OMPI_SESSION_DIR = "OMPI_MCA_orte_jobfam_session_dir"  # node-local, made and removed by mpirun
_OMPI_WORKING_DIR = "OMPI_MCA_initial_wdir"
_OMPI_MPIRUN_URI = "OMPI_MCA_orte_hnp_uri"  # mpirun's own addresses
_OMPI_NUM_NODES = "OMPI_MCA_orte_num_nodes"


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int  # this node's index
    cross_size: int  # the number of nodes
    launcher: str  # torchrun, slurm, mpirun or single


def _int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise KeyError(name)
        return default
    return int(value)


def detect() -> World:
    """This process's place in the job, from the environment (see the module doc)."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        rank, size = _int("RANK"), _int("WORLD_SIZE")
        local_size = _int("LOCAL_WORLD_SIZE", size)
        nodes = _int("GROUP_WORLD_SIZE", max(1, size // local_size))
        node = _int("GROUP_RANK", rank // local_size)
        return World(rank, size, _int("LOCAL_RANK", 0), local_size, node, nodes, "torchrun")
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        rank, size = _int("OMPI_COMM_WORLD_RANK"), _int("OMPI_COMM_WORLD_SIZE")
        local_size = _int("OMPI_COMM_WORLD_LOCAL_SIZE")
        nodes = _int(_OMPI_NUM_NODES, max(1, size // local_size))
        # Open MPI maps by slot: a node's ranks are consecutive
        return World(rank, size, _int("OMPI_COMM_WORLD_LOCAL_RANK"), local_size, rank // local_size, nodes, "mpirun")
    if "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ:
        from submitit.helpers import TorchDistributedEnvironment

        os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # submitit's own jobs set it; a bare srun does not
        env = TorchDistributedEnvironment()
        nodes = _int("SLURM_STEP_NUM_NODES", _int("SLURM_NNODES", 1))
        return World(
            env.rank, env.world_size, env.local_rank, env.local_world_size, _int("SLURM_NODEID", 0), nodes, "slurm"
        )
    return World(0, 1, 0, 1, 0, 1, "single")


def export_rendezvous(world: World) -> None:
    """Sets MASTER_ADDR and MASTER_PORT (and RANK, WORLD_SIZE, LOCAL_RANK) for env://."""
    from dtf.dist.env import free_port

    os.environ.update(RANK=str(world.rank), WORLD_SIZE=str(world.size), LOCAL_RANK=str(world.local_rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world.local_size))
    if world.launcher == "torchrun":
        return
    if world.launcher == "single":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return
    if world.launcher == "slurm":
        from submitit.helpers import TorchDistributedEnvironment

        from dtf.launch.slurm import step_port

        os.environ.setdefault("MASTER_PORT", str(step_port()))
        os.environ.setdefault("MASTER_ADDR", TorchDistributedEnvironment().master_addr)
        return
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:  # mpirun -x MASTER_ADDR=... -x MASTER_PORT=...
        return
    address, port = mpirun_rendezvous(world.rank, world.cross_size)
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))


def rendezvous_file(num_nodes: int) -> Path:
    """Where rank 0 of an mpirun job leaves its address (see the module doc)."""
    job = os.environ.get(_OMPI_JOB_ID, "0")
    if num_nodes == 1 and os.environ.get(_OMPI_SESSION_DIR):
        directory = Path(os.environ[_OMPI_SESSION_DIR])
    else:
        directory = Path(os.environ.get(_OMPI_WORKING_DIR) or os.getcwd())
    return directory / f"dtf-horovod-{job}.rendezvous"


def mpirun_rendezvous(rank: int, num_nodes: int) -> tuple[str, int]:
    """Rank 0 publishes a free port and its address; every rank returns them."""
    from dtf.dist.env import free_port
    from dtf.files import write_atomically

    path = rendezvous_file(num_nodes)
    if rank == 0:
        address = "127.0.0.1" if num_nodes == 1 else _address_towards_mpirun()
        port = free_port()
        write_atomically(path, f"{address}:{port}")
        return address, port
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"dtf.horovod: rank 0 of this mpirun job left no address in {path} within "
                f"{RENDEZVOUS_TIMEOUT_S:.0f} s: run mpirun from a directory every node shares, or give the "
                "rendezvous yourself: mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<a free port> ..."
            )
        time.sleep(0.05)
    address, _, port_text = path.read_text().rpartition(":")
    return address, int(port_text)


def remove_rendezvous_file() -> None:
    """Once every rank has joined the group (rank 0 of an mpirun job): nobody reads it any more."""
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        rendezvous_file(_int(_OMPI_NUM_NODES, 1)).unlink(missing_ok=True)


def _address_towards_mpirun() -> str:
    """This node's address on its route to mpirun's host (its IPv4 addresses are in orte_hnp_uri)."""
    from dtf.launch.nodes import route_source

    uri = os.environ.get(_OMPI_MPIRUN_URI, "")
    for hosts, port in re.findall(r"tcp://([0-9.,]+):(\d+)", uri):
        for host in hosts.split(","):
            try:
                return route_source(host, int(port))
            except OSError:
                continue
    raise RuntimeError(
        "dtf.horovod: this mpirun job runs on several nodes and mpirun's address is not known here "
        "(OMPI_MCA_orte_hnp_uri): give the rendezvous with mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port>"
    )
