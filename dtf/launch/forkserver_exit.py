"""Preloaded by the local launcher's forkserver (dtf.launch.local.preloaded_forkserver): the server
ends, once its run's last rank has, without the interpreter's teardown of the modules it imported
for the ranks (about 1 s of CPU with torch and torchmetrics, as dtf.results.exit_now says; a command
whose output is piped waits for it). Imported anywhere else, it does nothing."""

from __future__ import annotations

import atexit
import os
import sys

SERVER = "DTF_FORKSERVER"  # set only in the server's environment, and taken out of it here


def _leave(server: int) -> None:
    if os.getpid() != server:  # never in a rank (they end with os._exit anyway)
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if os.environ.pop(SERVER, None) == "1":  # (the ranks fork from the server after this)
    atexit.register(_leave, os.getpid())
