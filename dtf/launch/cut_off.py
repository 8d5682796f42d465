"""On a node of a multi-node run: a node cut off from the others ends by itself, and says so.

When the network to the other nodes is cut, this node's ranks end within their collective timeout
(trainer.dist_timeout_s). Its elastic agent then talks to the rendezvous store on the first node
(a keep-alive, the close of the rendezvous), and torch's store client waits on its socket for as
long as the cut lasts: seen here, the node never ended while cut off. So the driver watches: once
every rank it started has ended and the agent has still not returned GRACE_S later, it dials the
rendezvous endpoint; where nothing answers, it says which node it lost and ends.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from dtf import failures
from dtf.heartbeat import HEARTBEAT_DIR, read
from dtf.launch.stalls import started_here

GRACE_S = 10.0  # the agent's own shutdown takes well under a second while the store answers
DIAL_S = 5.0
POLL_S = 1.0
EXIT_STATUS = 1  # a rank failed: the run stopped


def reachable(host: str, port: int, timeout_s: float = DIAL_S) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended: its parent has only not reaped it yet


class CutOffWatch:
    """A thread on a node's driver: ends the driver when its ranks have ended and the rendezvous
    host no longer answers."""

    def __init__(self, run_dir: str | Path, endpoint: str, this_node: str, grace_s: float = GRACE_S) -> None:
        self.run_dir, self.endpoint, self.this_node, self.grace_s = run_dir, endpoint, this_node, grace_s
        host, _, port = endpoint.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dtf-cut-off-watch", daemon=True)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()

    def _watch(self) -> None:
        mine: set[int] = set()  # the ranks this driver started (their heartbeats say which pids)
        ended_at: float | None = None
        while not self._stop.wait(POLL_S):
            for path in (Path(self.run_dir) / HEARTBEAT_DIR).glob("rank_*.json"):
                beat = read(path)
                if beat is not None and beat.pid not in mine and started_here(beat.pid):
                    mine.add(beat.pid)
            if not mine or any(_alive(pid) for pid in mine):
                ended_at = None
                continue
            ended_at = ended_at if ended_at is not None else time.monotonic()
            waited = time.monotonic() - ended_at
            if waited >= self.grace_s and not self._stop.is_set() and not reachable(self.host, self.port):
                self._end(waited)

    def _end(self, waited: float) -> None:
        failure = failures.blamed(self.run_dir)
        why = f" ({failure.error().args[0]})" if failure is not None else ""
        line = (
            f"dtf: error: this node ({self.this_node}) is cut off from the run: its ranks ended{why}, and "
            f"{waited:.0f} s later the rendezvous host {self.endpoint} (launcher.rdzv_endpoint) does not answer: "
            "the network between the nodes was cut, or that node was lost; the same command on every node "
            "continues from the newest checkpoint"
        )
        with contextlib.suppress(OSError):
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        os._exit(EXIT_STATUS)  # the agent's threads wait on a socket that nothing will answer
