"""Runs that span several machines: where the nodes meet, which network interface reaches the
others (gloo and NCCL bind to it), which ranks ran where, and what a lost node looks like."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtf import failures
from dtf.config.schema import LocalLauncherConfig
from dtf.dist.network import interface_address, route_source
from dtf.errors import UserError

if TYPE_CHECKING:
    from dtf.dist.env import DistEnv

NODES_FILE = "logs/nodes.json"


def record_nodes(run_dir: Path, env: DistEnv) -> None:
    """<run_dir>/logs/nodes.json: each rank's address, so that a driver whose ranks lost a peer
    (connection closed by <address>) can name the node and the ranks that went away."""
    import torch.distributed as dist  # in the ranks only: the driver imports this module too

    address = interface_address(os.environ.get("GLOO_SOCKET_IFNAME", "")) or route_source(
        socket.gethostbyname(os.environ.get("MASTER_ADDR", "127.0.0.1")), 9
    )
    everyone: list[object] = [None] * env.world_size
    dist.all_gather_object(everyone, address)
    if env.is_main:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / NODES_FILE).write_text(json.dumps({"ranks": {str(r): a for r, a in enumerate(everyone)}}) + "\n")


class Nodes:
    """Where the nodes of a multi-node run meet (launcher.nnodes > 1), and how they reach each
    other: the rendezvous endpoint, this node's address on the interface that routes there, and
    that interface's name for gloo and NCCL."""

    def __init__(self, endpoint: str, node_rank: int | None, interface: str, address: str) -> None:
        self.endpoint, self.node_rank, self.interface, self.address = endpoint, node_rank, interface, address

    @classmethod
    def of(cls, cfg: LocalLauncherConfig) -> Nodes:
        endpoint = str(cfg.rdzv_endpoint)
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise UserError(
                f"launcher.rdzv_endpoint={endpoint} is not host:port: give the first node's name or address "
                "and a free port, e.g. launcher.rdzv_endpoint=node1:29500"
            )
        try:
            target = socket.gethostbyname(host)
        except OSError:
            raise UserError(
                f"launcher.rdzv_endpoint={endpoint}: {host} does not resolve on this node: use a name this node "
                "resolves, or the first node's address"
            ) from None
        if cfg.network_interface is not None:
            interface = cfg.network_interface
            address = interface_address(interface)
            if address is None:
                names = ", ".join(name for _, name in socket.if_nameindex())
                raise UserError(
                    f"launcher.network_interface={interface} is not an interface of this node with an IPv4 "
                    f"address (it has: {names}): name one, or leave it unset to use the one that reaches {host}"
                )
        else:
            address = route_source(target, int(port))
            interface = next((name for _, name in socket.if_nameindex() if interface_address(name) == address), "")
            if not interface:
                raise UserError(
                    f"launcher.rdzv_endpoint={endpoint}: no network interface of this node reaches {target}: "
                    "check the address, or name the interface with launcher.network_interface"
                )
        return cls(endpoint, cfg.node_rank, interface, address)

    def run_id(self) -> str:
        return "dtf-" + hashlib.sha256(self.endpoint.encode()).hexdigest()[:12]

    def rdzv_configs(self) -> dict[str, Any]:
        # node_rank 0 hosts the rendezvous store; unset: torch decides by the endpoint's address
        return {} if self.node_rank is None else {"is_host": self.node_rank == 0}


def lost_node(failure: failures.RankFailure, run_dir: str) -> str | None:
    """A rank that failed because a peer on another node went away (its processes died, or its
    network): which node that was and which ranks ran there, from gloo's error (which names the
    peer's address) and <run_dir>/logs/nodes.json."""
    address = failure.lost_peer
    if address is None:
        return None
    try:
        ranks = json.loads((Path(run_dir) / NODES_FILE).read_text())["ranks"]
    except (OSError, ValueError, KeyError):
        ranks = {}
    there = sorted(int(r) for r, a in ranks.items() if a == address)
    try:
        name = f"{socket.gethostbyaddr(address)[0]} ({address})"
    except OSError:
        name = address
    who = f", ranks {', '.join(map(str, there))}" if there else ""
    return (
        f"lost the node {name}{who}: its processes died or it dropped off the network, and rank "
        f"{failure.rank} saw its connection close; the run stopped, and the same command on every node "
        "continues it from the last checkpoint"
    )


@contextlib.contextmanager
def between_nodes(nodes: Nodes | None) -> Iterator[None]:
    """gloo, NCCL (and TensorPipe) bind to the interface that reaches the other nodes, not to
    whatever the machine's name resolves to (often 127.0.1.1, or a management network)."""
    if nodes is None:
        yield
        return
    keys = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
    saved = {k: os.environ.get(k) for k in keys}
    for key in keys:
        os.environ.setdefault(key, nodes.interface)  # a user's own setting wins
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
