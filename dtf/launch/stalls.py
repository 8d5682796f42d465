"""On the driver: a rank that stopped making progress (a hang in its forward, its data, a deadlock)
is found from the ranks' heartbeats (dtf.heartbeat), named, and killed at once, long before
the collective timeout (trainer.dist_timeout_s) would end the run by the error of a healthy peer
that timed out waiting for it.

The run is stalled when no rank's heartbeat has moved for the stall timeout: trainer.stall_timeout_s,
or by default the larger of STALL_FLOOR_S and STALL_STEPS times the median step time. While a rank
has not finished its first step (start-up, compilation) or writes a checkpoint, the collective
timeout applies instead: those take as long as they take. The ranks that stalled are those that
got the least far (the fewest marks): their peers went on to the next collective and wait there.
The driver records why (dtf.failures: the driver reports that rank) and kills them with SIGKILL,
without the grace a stop signal gets: a hung rank could not act on it anyway. Where every rank is
at the same mark (a collective that never completes), all of them are.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from dtf import failures
from dtf.heartbeat import HEARTBEAT_DIR, Beat, read

STALL_FLOOR_S = 300.0
STALL_STEPS = 50  # median step times
POLL_S = 1.0
# Phases that take as long as they take (a large checkpoint, the final export): the collective
# timeout, not the stall timeout, bounds them.
LONG_PHASES = ("setting up", "saving a checkpoint", "finishing")


class StallWatch:
    """A thread on the driver that watches the ranks of this run (those of this host it may kill)."""

    def __init__(self, run_dir: str | Path, timeout_s: float | None, collective_timeout_s: float) -> None:
        self.root = Path(run_dir) / HEARTBEAT_DIR
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.host = socket.gethostname()
        self._seen: dict[int, tuple[int, int, float]] = {}  # rank -> (pid, marks, when they last moved)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dtf-stall-watch", daemon=True)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            beats = {b.rank: b for b in map(read, self.root.glob("rank_*.json")) if b is not None}
            if beats and self.check(beats, time.monotonic()):
                return

    def allowance(self, beats: dict[int, Beat]) -> float:
        """How long the run may make no progress where it stands now."""
        if any(not b.first_step_done or b.phase in LONG_PHASES for b in beats.values()):
            return max(self.collective_timeout_s, self.timeout_s or 0.0)
        if self.timeout_s is not None:
            return self.timeout_s
        step_s = max((b.step_s for b in beats.values() if b.step_s is not None), default=0.0)
        return max(STALL_FLOOR_S, STALL_STEPS * step_s)

    def check(self, beats: dict[int, Beat], now: float) -> bool:
        """Given the ranks' latest beats: kills the ranks of a stalled run. True once it has."""
        for rank, beat in beats.items():
            pid, marks, _ = self._seen.get(rank, (0, -1, now))
            if (pid, marks) != (beat.pid, beat.marks):  # moved (or a restarted rank)
                self._seen[rank] = (beat.pid, beat.marks, now)
        still_s = now - max(moved for _, _, moved in self._seen.values())
        allowed = self.allowance(beats)
        if still_s < allowed:
            return False
        least = min(b.marks for b in beats.values())
        stalled = sorted(r for r, b in beats.items() if b.marks == least)
        everyone = len(stalled) == len(beats)
        for rank in stalled:
            beat = beats[rank]
            where = f"{beat.phase} of step {beat.step + 1}"
            if everyone:
                message = (
                    f"no rank made progress for {still_s:.0f} s (trainer.stall_timeout_s: {allowed:.0f} s); every "
                    f"rank was in {where} (a collective that does not complete?); the ranks were killed"
                )
            else:
                waiting = ", ".join(str(r) for r in sorted(beats) if r not in stalled)
                message = (
                    f"made no progress for {still_s:.0f} s in {where} (trainer.stall_timeout_s: {allowed:.0f} s), "
                    f"while rank(s) {waiting} waited for it; it was killed"
                )
            failure = failures.RankFailure(rank, time.time_ns(), False, message, "", everyone)
            failures.write(self.run_dir, beat.attempt, failure)
        for rank in stalled:
            beat = beats[rank]
            if beat.host == self.host and started_here(beat.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(beat.pid, signal.SIGKILL)
        return True


def started_here(pid: int) -> bool:
    """Whether this process started that rank: as its parent, or through the run's forkserver
    (dtf.launch.local.preloaded_forkserver), which this process started."""
    parent = _parent_of(pid)
    return parent is not None and os.getpid() in (parent, _parent_of(parent))


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
