"""Whether the kernel's out-of-memory killer ended a rank. A rank that dies of SIGKILL with nobody
asking is most often that, and its user needs to hear "out of memory", not a signal's name.

The memory cgroup the run runs in counts the processes the OOM killer ended in it and below
(cgroup v2: `oom_kill` in memory.events; v1: in memory.oom_control): the driver reads the count
before the ranks start and again when one is killed. Where no cgroup counts (v2's root), the
kernel's log names the process it killed. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def counters(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> list[Path]:
    """The files that count OOM kills in this process's memory cgroup (and those below it)."""
    found = []
    with contextlib.suppress(OSError):
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            relative = path.lstrip("/")
            if controllers == "":  # cgroup v2, mounted at the root or beside v1 as "unified"
                found += [root / relative / "memory.events", root / "unified" / relative / "memory.events"]
            elif "memory" in controllers.split(","):
                found.append(root / "memory" / relative / "memory.oom_control")
    return [path for path in found if path.is_file()]


def _oom_kills(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


class OomKills:
    """The OOM killer's count in this run's memory cgroup, taken before its ranks start."""

    def __init__(self) -> None:
        self.before = {path: _oom_kills(path) for path in counters()}

    def ended(self, pid: int | None) -> str | None:
        """How we know the OOM killer ended a process of the run since (the one of that pid), or None."""
        for path, before in self.before.items():
            now = _oom_kills(path)
            if before is not None and now is not None and now > before:
                return f"oom_kill {before} -> {now} in {path}"
        if pid and _in_kernel_log(pid):
            return f"the kernel's log: process {pid} killed"
        return None


def _in_kernel_log(pid: int) -> bool:
    """Whether the kernel's log (/dev/kmsg, readable by root) says the OOM killer killed pid. The pid
    is the kernel's: a rank in a pid namespace of its own is not found here."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    wanted = (f"Killed process {pid} ".encode(), f",pid={pid},".encode())
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                return False  # read to its end
            except OSError as e:
                if e.errno == errno.EPIPE:  # records overwritten while reading: go on with the next
                    continue
                return False
            if not record:
                return False
            if any(w in record for w in wanted):
                return True
    finally:
        os.close(fd)
