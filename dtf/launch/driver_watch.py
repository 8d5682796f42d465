"""A rank of launcher=local ends once its driver is gone (`python -m dtf` killed with SIGKILL, or
by the kernel's OOM killer): nobody is left to collect its result, and it would train on, writing
checkpoints into the run directory a rerun of the same command then shares with it.

The ranks run in sessions of their own (dtf.launch.local.in_own_session), and their parent is the
run's forkserver, which can outlive the driver, so neither a kill of the driver's process group
nor torch's parent-death signal reaches them. Each rank watches the driver's pid instead (a pidfd:
readable once the process has ended, no polling). When it ends, a rank of a one-node run stops
as on a stop signal: the ranks agree on a step, save one checkpoint and stop (the same command
continues the run), and a rank still alive `grace_s` later ends at once. A rank of a run over
several nodes ends at once: its node is lost, which the other nodes handle (an elastic run goes
on without it) where a stop agreed with them would stop them all. Linux only; elsewhere nothing.

Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading

from dtf.results import EXIT_STOPPED

_finished = threading.Event()


def watch(driver: int, rank: int, stop_signals: list[str], grace_s: float) -> None:
    """In a rank, at its start: end once the driver (pid) ends, stopping at a checkpoint first with
    the first of stop_signals (none: at once; see the module doc)."""
    try:
        fd: int | None = os.pidfd_open(driver)  # type: ignore[attr-defined,unused-ignore]
    except ProcessLookupError:
        fd = None  # already gone
    except (AttributeError, OSError):
        return  # no pidfd here (not Linux, or an old kernel): nothing watched
    threading.Thread(target=_wait, args=(fd, driver, rank, stop_signals, grace_s), daemon=True).start()


def finished() -> None:
    """The rank's work has returned: once the driver is gone, nothing is left to wait for."""
    _finished.set()


def _wait(fd: int | None, driver: int, rank: int, stop_signals: list[str], grace_s: float) -> None:
    if fd is not None:
        select.select([fd], [], [])  # until the driver has ended
    how = "stopping at a checkpoint" if stop_signals else "ending"
    with contextlib.suppress(OSError, ValueError):  # (the terminal may be gone with it)
        print(
            f"dtf: rank {rank}: the driver (pid {driver}) is gone: {how}; the same command continues the run",
            file=sys.stderr,
            flush=True,
        )
    if stop_signals:
        os.kill(os.getpid(), signal.Signals[stop_signals[0]])  # the rank's own handler: agree, save, stop
        _finished.wait(grace_s)
    os._exit(EXIT_STOPPED)
