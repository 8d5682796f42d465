"""Each rank's progress, for the driver to tell a rank that stopped making progress (a hang) from
its peers, which only wait for it in a collective (dtf.launch.stalls).

The training loop marks every change of what it does (waiting for data, forward, backward, the
optimizer step, an evaluation batch, a checkpoint, ...): an attribute update, no I/O. Every rank
passes through the same marks in the same order, so the number of marks tells how far each got:
a rank hung in its forward has one mark fewer than its peers, which went on to backward and wait
there for its gradients. A thread writes the mark, when it changed, to
<run_dir>/logs/heartbeat/rank_<r>.json about every BEAT_S seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from dtf.files import write_atomically

HEARTBEAT_DIR = Path("logs") / "heartbeat"
BEAT_S = 1.0


@dataclass(frozen=True)
class Beat:
    rank: int
    pid: int
    host: str
    attempt: int
    marks: int  # how many marks so far: equal on ranks at the same point
    phase: str  # what the rank does now
    step: int  # the optimizer steps it finished
    first_step_done: bool  # compilation, warm-up and the first collectives are behind it
    step_s: float | None  # the median time of its recent steps


def path_of(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"rank_{rank}.json"


def read(path: Path) -> Beat | None:
    try:
        return Beat(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # not there yet, or half a file


class Heartbeat:
    """A rank's marks, and the thread that writes them."""

    def __init__(self, run_dir: Path | None, rank: int, attempt: int) -> None:
        self.path = path_of(run_dir, rank) if run_dir is not None else None  # None: marks only, nothing written
        self.rank, self.attempt = rank, attempt
        self.marks = 0
        self.phase = "setting up"
        self.step = 0
        self.first_step_done = False
        self.step_times: list[float] = []  # the trainer's, read by the writer
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def mark(self, phase: str) -> None:
        self.marks += 1
        self.phase = phase

    def stepped(self, step: int) -> None:
        self.step = step
        self.first_step_done = True
        self.mark("after an optimizer step")

    def start(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread = threading.Thread(target=self._beat, name="dtf-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self) -> None:
        written = self.marks
        while not self._stop.wait(BEAT_S):
            if self.marks != written:
                written = self.marks
                self._write()

    def _write(self) -> None:
        assert self.path is not None
        recent = self.step_times[-50:]
        beat = Beat(
            self.rank,
            os.getpid(),
            socket.gethostname(),
            self.attempt,
            self.marks,
            self.phase,
            self.step,
            self.first_step_done,
            statistics.median(recent) if recent else None,
        )
        with contextlib.suppress(OSError):  # a full disk: the run goes on; the collective timeout bounds a hang
            write_atomically(self.path, json.dumps(asdict(beat)))
