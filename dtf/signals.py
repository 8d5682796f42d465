"""Stop requests by signal: what SLURM (and schedulers like it) send before preemption or the
time limit. A handler only records the request; the training loop acts on it at a step
boundary that all ranks agree on (dtf.train.control), saves one checkpoint and ends the
run with exit status 75 (dtf.results.EXIT_STOPPED), which a launcher can turn into a requeue.

Standard library only: the driver imports it to validate and to report.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

STOPPABLE_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")


def ignore_stop_signals() -> None:
    """In a rank's helper processes (DataLoader workers, Petastorm's reader processes): ignore what
    the rank itself handles. torchrun, Kubernetes and SLURM signal every process of a job (SIGTERM,
    SLURM's warning signal), and by default a helper dies of it, which kills the rank before it can
    save. Helpers still end with the rank (they watch their parent, or are shut down by it)."""
    for name in STOPPABLE_SIGNALS:
        signal.signal(signal.Signals[name], signal.SIG_IGN)


class StopRequest:
    """Installs handlers for the named signals (main thread only) and remembers the first one.
    sigint_kills: SIGINT, unless named, gets its default action (the process dies of it)."""

    def __init__(self, names: list[str] | tuple[str, ...], sigint_kills: bool = False) -> None:
        self.signal_name: str | None = None
        self._previous: dict[signal.Signals, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; nothing to catch here
        for name in names:
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._handle)
        if sigint_kills and "SIGINT" not in names:
            # In a rank, Ctrl-C that is not a stop request kills at once, as SIGHUP or SIGQUIT do, instead
            # of unwinding a KeyboardInterrupt (a traceback per rank, and none at all inside a collective).
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
