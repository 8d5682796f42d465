"""A run holds its run directory: a second run started in it (a requeued job whose first instance
still runs, a command started twice) is refused in one line naming the holder, before it writes
anything there. Standard library only: the driver takes the hold before any rank starts.

How: an exclusive flock(2) on <run_dir>/.dtf.lock, which the kernel releases when the holder dies
(kill -9 included), so a dead holder never blocks the next run. The file also holds the holder's
host, pid, start time and a heartbeat it rewrites every BEAT_S seconds. flock alone is not enough
on shared file systems: NFS mounted with nolock, Lustre with localflock and BeeGFS (by default)
keep locks on the node that took them, where a run on another node never sees them, and some
refuse locks altogether (ENOLCK). So a run that finds the record of another host observes its
heartbeat: a record its holder ended, or one whose heartbeat is older than STALE_S, is free at
once; otherwise the newcomer waits up to STALE_S for the next beat, and refuses if it comes (the
holder lives) or takes over if it does not (the holder's node is gone).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from dtf.errors import UserError

LOCK_FILE = ".dtf.lock"
BEAT_S = 5.0
STALE_S = 3 * BEAT_S
# Set while this process holds a run dir, for the ranks it starts: they need not take it again.
HELD_ENV = "DTF_RUN_DIR_HELD"

_held: dict[Path, RunDirHold] = {}  # this process's holds, by resolved run dir
_held_lock = threading.Lock()


class RunDirHold:
    """This process's hold on one run dir: the locked file and its heartbeat thread."""

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir, self.fd = run_dir, fd
        self.since = time.time()
        self.count = 1  # nested holds in one process (the command line's, then the launch's)
        self._stop = threading.Event()
        self._write(ended=False)
        self._beats = threading.Thread(target=self._beat, name="dtf-run-dir-heartbeat", daemon=True)
        self._beats.start()

    def _write(self, ended: bool) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": self.since, "beat": time.time()}
        data = json.dumps({**record, "ended": ended}).encode()
        with contextlib.suppress(OSError):  # a full disk must not end the run; the lock still holds
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._write(ended=False)

    def release(self) -> None:
        self._stop.set()
        self._beats.join()
        self._write(ended=True)
        os.close(self.fd)  # releases the flock


@contextlib.contextmanager
def holding(run_dir: str | Path, key: str = "hydra.run.dir") -> Iterator[None]:
    """Holds run_dir while the block runs (UserError naming the holder when another run has it)."""
    hold(run_dir, key)
    try:
        yield
    finally:
        release(run_dir)


def hold(run_dir: str | Path, key: str = "hydra.run.dir") -> None:
    """Takes run_dir for this process until release() or the process's end. key: the setting that
    names run_dir, for the refusal."""
    path = Path(run_dir).resolve()
    with _held_lock:
        if path in _held:
            _held[path].count += 1
            return
        try:
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a run dir (or its lock file) left read-only
            raise UserError(
                f"{key}={path} cannot be written ({path / LOCK_FILE}: {e.strerror or type(e).__name__}): make it "
                f"writable (chmod -R u+w {path}, or mount it read-write) and run the same command again, or give "
                f"{key} a directory you can write to"
            ) from None
        try:
            _acquire(fd, path, key)
        except BaseException:
            os.close(fd)
            raise
        if not _held:
            atexit.register(_release_all)  # a run that ends by SystemExit says so in the file too
        _held[path] = RunDirHold(path, fd)
        os.environ[HELD_ENV] = str(path)


def release(run_dir: str | Path) -> None:
    path = Path(run_dir).resolve()
    with _held_lock:
        held = _held.get(path)
        if held is None:
            return
        held.count -= 1
        if held.count == 0:
            del _held[path]
            held.release()
            if os.environ.get(HELD_ENV) == str(path):
                del os.environ[HELD_ENV]


def _release_all() -> None:
    for path in list(_held):
        _held[path].count = 1
        release(path)


def held_by_parent(run_dir: str | Path) -> bool:
    """Whether the process that started this one holds run_dir (the ranks of a local launcher)."""
    return os.environ.get(HELD_ENV) == str(Path(run_dir).resolve())


def _acquire(fd: int, path: Path, key: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = True
    except BlockingIOError:
        raise _refusal(path, key, _read_settled(fd)) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        locked = False  # a file system without locks: the heartbeat alone tells
    record = _read(fd)
    if not record or record.get("ended"):
        return
    if record.get("host") == socket.gethostname():
        if locked or not _alive(int(record.get("pid", 0))):
            return  # the kernel released the holder's lock: it is gone
        raise _refusal(path, key, record)
    if time.time() - float(record.get("beat", 0)) > STALE_S:
        return
    moved = _beats_on(fd, record)
    if moved is not None:  # another host's run, whose lock this node may not see
        raise _refusal(path, key, moved)


def _beats_on(fd: int, record: dict[str, Any]) -> dict[str, Any] | None:
    """The holder's record if its heartbeat moves within STALE_S (it is alive), else None. A read
    that finds the record empty (the heartbeat truncates, then writes) counts as a move, and the
    record is then the one read before."""
    deadline = time.monotonic() + STALE_S
    while time.monotonic() < deadline:
        time.sleep(min(1.0, BEAT_S / 5))
        now = _read(fd)
        if now.get("ended"):
            return None
        if now.get("beat") != record.get("beat"):
            return now or record
    return None


def _read_settled(fd: int) -> dict[str, Any]:
    """The holder's record, read again for a moment while its heartbeat has it half written."""
    for _ in range(20):
        record = _read(fd)
        if record:
            return record
        time.sleep(0.01)
    return {}


def _read(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}  # half written, or not dtf's
    return data if isinstance(data, dict) else {}


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _refusal(path: Path, key: str, record: dict[str, Any]) -> UserError:
    if record.get("pid"):
        since = datetime.fromtimestamp(float(record.get("since", 0))).isoformat(sep=" ", timespec="seconds")
        holder = f"pid {record['pid']} on host {record.get('host', '?')}, since {since}"
    else:
        holder = f"a process that has it locked ({path / LOCK_FILE})"
    return UserError(
        f"{key}={path} is in use by another run ({holder}): wait for that run to end, or give this run another {key}"
    )
