"""What a process that dtf spawns beside a rank or a sweep needs: not to run the program's
__main__ again, and to end with the process that started it.

Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
from collections.abc import Iterator
from typing import Any

_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def main_script_hidden() -> Iterator[None]:
    """While spawned processes start: spawn would import the program's __main__ in each of them (a
    script without a main guard would run again, and start processes of its own). They need only
    dtf's modules, which they import to unpickle what they are given."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved: dict[str, Any] = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def end_with_parent(sig: signal.Signals) -> None:
    """In a spawned process: receive sig when the thread that started it ends (its process dies,
    even by SIGKILL), so that it never lives on as an orphan (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)


def quiet_when_a_receiver_dies() -> None:
    """In a DataLoader worker: a batch's tensors reach the rank as file descriptors that the worker's
    resource sharer serves on a thread of its own. A rank that dies while it collects one (Ctrl-C
    kills a rank at once) leaves that thread a reset or closed connection, which it printed as a
    traceback after the run had already been reported as interrupted. Only that error, from only that
    thread, is dropped; the worker ends with its rank as before."""
    from multiprocessing import resource_sharer

    sharer = getattr(resource_sharer, "_ResourceSharer", None)
    serve = getattr(getattr(sharer, "_serve", None), "__code__", None)
    if serve is None:  # another Python's multiprocessing: leave its reporting alone
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, (ConnectionError, EOFError)) and tb is not None and tb.tb_frame.f_code is serve:
            return
        previous(kind, value, tb)

    sys.excepthook = hook
