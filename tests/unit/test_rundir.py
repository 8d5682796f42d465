"""A run holds its run directory (dtf.rundir): another process is refused while the holder lives,
and a dead holder blocks nobody, whether the kernel's lock or only the heartbeat tells."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtf import rundir
from dtf.errors import UserError

REPO = Path(__file__).resolve().parents[2]
HOLD_IN_CHILD = (
    "import sys, time; from dtf import rundir; rundir.hold(sys.argv[1]); print('held', flush=True); time.sleep(60)"
)


def _holder(run_dir: Path) -> subprocess.Popen[str]:
    """Another process that holds run_dir until it is killed."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_IN_CHILD, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def _record(run_dir: Path, **fields: object) -> None:
    (run_dir / rundir.LOCK_FILE).write_text(json.dumps(fields))


def test_a_live_holder_refuses_the_next_run_naming_itself_and_a_killed_one_does_not(tmp_path: Path) -> None:
    child = _holder(tmp_path)
    try:
        with pytest.raises(UserError) as refused:
            rundir.hold(tmp_path)
        line = str(refused.value)
        assert line.startswith(f"hydra.run.dir={tmp_path.resolve()} is in use by another run (pid {child.pid} on host ")
        assert f"host {socket.gethostname()}, since " in line and "give this run another hydra.run.dir" in line
    finally:
        child.kill()  # kill -9: the kernel releases its lock
        child.wait()
    with rundir.holding(tmp_path):
        assert rundir.held_by_parent(tmp_path)  # what ranks started now see
    assert json.loads((tmp_path / rundir.LOCK_FILE).read_text())["ended"] is True


def test_holds_nest_in_one_process(tmp_path: Path) -> None:
    with rundir.holding(tmp_path), rundir.holding(tmp_path):
        pass
    with rundir.holding(tmp_path):  # released once the outer hold ends
        pass


@pytest.fixture
def quick_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rundir, "BEAT_S", 0.2)
    monkeypatch.setattr(rundir, "STALE_S", 0.6)


def test_another_hosts_record_whose_heartbeat_moves_refuses_and_one_whose_does_not_is_taken_over(
    tmp_path: Path, quick_heartbeat: None
) -> None:
    # Where flock is local to each node (NFS with nolock, Lustre's localflock), a run on another
    # host is seen only through its record: a moving heartbeat means it lives.
    beating = {"host": "node-elsewhere", "pid": 4242, "since": time.time(), "beat": time.time(), "ended": False}
    _record(tmp_path, **beating)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json, sys, time\n"
            "for i in range(30):\n"
            f"    r = {beating!r}; r['beat'] = time.time()\n"
            "    open(sys.argv[1], 'w').write(json.dumps(r)); time.sleep(0.1)",
            str(tmp_path / rundir.LOCK_FILE),
        ]
    )
    try:
        with pytest.raises(UserError, match="pid 4242 on host node-elsewhere"):
            rundir.hold(tmp_path)
    finally:
        child.kill()
        child.wait()
    _record(tmp_path, **{**beating, "beat": time.time()})  # fresh, but its node is gone: no next beat
    started = time.monotonic()
    with rundir.holding(tmp_path):
        assert time.monotonic() - started >= 0.5
    for stale in ({"beat": time.time() - 60}, {"ended": True}):  # taken at once
        _record(tmp_path, **{**beating, **stale})
        started = time.monotonic()
        with rundir.holding(tmp_path):
            assert time.monotonic() - started < 0.5


def test_the_refusal_names_another_hosts_run_caught_rewriting_its_record(
    tmp_path: Path, quick_heartbeat: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A heartbeat truncates the record, then writes it: a read in between finds the file empty.
    beating = {"host": "node-elsewhere", "pid": 4242, "since": time.time(), "beat": time.time(), "ended": False}
    _record(tmp_path, **beating)
    reads = iter([beating, {**beating, "beat": beating["beat"] + 1}])
    monkeypatch.setattr(rundir, "_read", lambda fd: next(reads, {}))
    with pytest.raises(UserError, match="pid 4242 on host node-elsewhere"):
        rundir.hold(tmp_path)


def test_without_file_locks_a_live_pid_on_this_host_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)
    here = {"host": socket.gethostname(), "since": time.time(), "beat": time.time(), "ended": False}
    _record(tmp_path, **here, pid=os.getppid())  # alive
    with pytest.raises(UserError, match=f"pid {os.getppid()} on host"):
        rundir.hold(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _record(tmp_path, **here, pid=dead.pid)
    with rundir.holding(tmp_path):
        pass
