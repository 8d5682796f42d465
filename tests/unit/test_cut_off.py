"""When a node's driver takes itself for cut off from the run (dtf.launch.cut_off): only once every
rank it started has ended, the grace has passed, and the rendezvous host does not answer."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from dtf import heartbeat
from dtf.launch import cut_off


def _rank(run_dir: Path, rank: int, pid: int) -> None:
    beat = heartbeat.Beat(rank, pid, socket.gethostname(), 0, 5, "backward", 3, True, 0.01)
    path = heartbeat.path_of(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(beat)))


def _watch(run_dir: Path, endpoint: str, monkeypatch: pytest.MonkeyPatch, rank_ends: bool = True) -> list[float]:
    """Watches a rank this process started (as the agent starts one), which ends (or not) while watched."""
    ended: list[float] = []
    monkeypatch.setattr(cut_off, "POLL_S", 0.05)
    watch = cut_off.CutOffWatch(run_dir, endpoint, "198.18.0.2", grace_s=0.2)
    monkeypatch.setattr(watch, "_end", ended.append)  # instead of ending this process
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as rank, watch.watching():
        _rank(run_dir, 1, rank.pid)
        time.sleep(0.3)
        if rank_ends:
            rank.kill()
        time.sleep(0.6)
        rank.kill()
    return ended


def _unused_port() -> str:
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{unused.getsockname()[1]}"


def test_a_node_whose_ranks_ended_and_whose_rendezvous_host_is_gone_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ended = _watch(tmp_path, _unused_port(), monkeypatch)
    assert ended and ended[0] >= 0.2


def test_a_node_whose_ranks_run_or_whose_rendezvous_host_answers_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        endpoint = f"127.0.0.1:{listening.getsockname()[1]}"
        assert _watch(tmp_path, endpoint, monkeypatch) == []  # ended, but the host answers: the agent's to finish
    assert _watch(tmp_path, _unused_port(), monkeypatch, rank_ends=False) == []  # its rank still runs
    _rank(tmp_path, 2, 1)  # a rank this process did not start (pid 1, alive): another node's, not waited for
    assert _watch(tmp_path, _unused_port(), monkeypatch)
