"""A launcher starts the ranks of one run and returns rank 0's result."""

from __future__ import annotations

import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtf.config.schema import CheckpointConfig
from dtf.config.typed import RunConfig
from dtf.errors import RankFailedError
from dtf.results import Finished, RunResult, Stopped

# dtf.rank.rank_main(run, run_dir) -> rank 0's result (None on other ranks)
WorkerFn = Callable[[RunConfig, str], Any]


class Launcher(ABC):
    def __init__(self, cfg: Any, checkpoint: CheckpointConfig | None = None) -> None:
        self.cfg = cfg  # the launcher's config dataclass (dtf.config.schema)
        # Where the run's checkpoints are, and the signals that stop it (the defaults if not given).
        self.checkpoint = checkpoint or CheckpointConfig()

    @abstractmethod
    def launch(self, fn: WorkerFn, run: RunConfig, run_dir: str) -> RunResult | None:
        """Run fn(run, run_dir) on every rank, with the run as the driver typed and froze it (pickled
        to the ranks); return how the run ended (rank 0's result), or raise the error of the rank
        that failed first (dtf.failures). None: this process is itself a rank other than 0 (started
        by torchrun or srun), which has nothing to report."""


def rank_result(result: Any) -> Finished | Stopped:
    """Rank 0's return value, which every launcher hands back as it is."""
    if not isinstance(result, Finished | Stopped):
        raise RankFailedError(f"rank 0 ended without a result ({result!r})")
    return result


def in_place_result(result: Any) -> RunResult | None:
    """What a process that is a rank itself returns: rank 0's result, or None on the other ranks."""
    return result if isinstance(result, Finished | Stopped) else None


class LogTail:
    """Prints the complete lines a rank's log file has gained since the last look (a line still
    being written waits for the next one), leaving out lines `hide` picks (a tool's bookkeeping)."""

    def __init__(self, path: Path, hide: Callable[[str], bool] = lambda line: False) -> None:
        self.path = path
        self.hide = hide
        self.shown = 0

    def print_new(self) -> None:
        try:
            text = self.path.read_text(errors="replace")
        except OSError:
            return  # not there yet
        complete = text.rfind("\n") + 1
        for line in text[self.shown : complete].splitlines(keepends=True):
            if not self.hide(line):
                sys.stdout.write(line)
        sys.stdout.flush()
        self.shown = max(self.shown, complete)

    def follow(self, stop: threading.Event, every_s: float = 0.5) -> None:
        """Prints new lines every every_s seconds until stop is set, and once more after (the last lines)."""
        while not stop.wait(every_s):
            self.print_new()
        self.print_new()
