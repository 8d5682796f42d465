"""What a run ends as, on its way from the ranks through a launcher to the command line, and the
exit status each outcome gives. Standard library only: the driver imports it to report.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, NoReturn

EXIT_OK = 0
EXIT_FAILED = 1  # a rank failed (a bug, a crash, a lost peer): its error names it
EXIT_USER_ERROR = 2  # a bad setting or input: one line names the key and the fix
# EX_TEMPFAIL from sysexits.h, "a temporary failure; the user is invited to retry": a stop signal
# ended the run after a checkpoint, and a requeueing scheduler may start it again.
EXIT_STOPPED = 75
EXIT_INTERRUPTED_BASE = 128  # + the signal's number, as for a process killed by it (130 for Ctrl-C)


@dataclass(frozen=True)
class Finished:
    """The run trained to its end; summary: rank 0's summary.json."""

    summary: dict[str, Any]


@dataclass(frozen=True)
class Stopped:
    """A stop signal ended the run at a checkpoint; the same command continues it."""

    signal: str | None  # None: it reached another rank, not this one
    step: int | None  # None: stopped before the first checkpoint
    checkpoint: str | None


@dataclass(frozen=True)
class Submitted:
    """A cluster job that runs on without the driver (launcher.wait=false, or a sweep's point)."""

    job_id: str


RunResult = Finished | Stopped | Submitted


def exit_now(code: int) -> NoReturn:
    """End a process dtf owns (the `python -m dtf` driver, a rank the local launcher spawned) as the
    interpreter would, less the teardown that frees every module's objects: about 1 s per process
    once torch and torchmetrics are loaded, at the end of every run. What a normal exit does first
    still happens: the other threads are waited for, the atexit functions run (logging's flush,
    multiprocessing's and torch's pools), stdout and stderr are flushed."""
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter: threading's exit hooks, then the joins
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_code(e: SystemExit) -> int:
    """The status a SystemExit ends the interpreter with (a message: printed, and 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
