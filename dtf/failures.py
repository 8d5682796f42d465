"""Why a run failed, told the same way whichever launcher started its ranks.

A rank that fails writes one small record before it dies (when, which rank, the error, its
traceback) to <run_dir>/logs/failures/attempt_<k>/rank_<r>.json. The driver, local, SLURM or
Spark alike, blames the rank whose record is oldest: its peers' errors ("connection closed by
peer") are the consequence, whichever of them a launcher happens to report. A user error is one
line; anything else prints that rank's traceback first. Standard library only: the driver reads
these without importing the training stack.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from dtf import heartbeat
from dtf.errors import RankFailedError, RankFault, TrainingFailed, UserError, user_error_in
from dtf.files import out_of_space, write_atomically

FAILURES_DIR = Path("logs") / "failures"

# gloo's words for a peer gone: "Connection closed by peer [a]:p", "Read error [a]:p: Connection
# reset by peer", "Write error [a]:p: Broken pipe"
_PEER_GONE = re.compile(r"(?:Connection closed by peer|Read error|Write error) \[([0-9.]+)\]")
# A collective's wait that ran out: gloo's "Timed out waiting 20000ms for recv operation to complete",
# NCCL's watchdog "... Timeout(ms)=600000) ran for 600012 milliseconds before timing out", a store's
# "wait timeout after 20000ms" or "Socket Timeout"
_TIMED_OUT = re.compile(
    r"Timed out waiting (\d+) ?ms|Timeout\(ms\)=(\d+)|wait timeout after (\d+) ?ms|"
    r"collective operation timeout|Socket Timeout",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class RankFailure:
    rank: int
    time_ns: int
    user_error: bool
    message: str  # the UserError's text, or "<ExceptionType>: <first line>"
    traceback: str  # empty for dtf.errors.TrainingFailed and RankFault, told in one line
    every_rank: bool = False  # every rank raised it at the same point: the driver names no rank

    def error(self, logs: str | None = None) -> UserError:
        """The error the driver reports: the user's one line, or which rank failed and how."""
        if self.user_error:  # bad input, found where the ranks run (exit status 2, as on the driver)
            return UserError(self.message if self.every_rank else f"{self.message} (rank {self.rank})")
        if self.every_rank:  # the run failed as a whole (it diverged): the line says why
            return RankFailedError(self.message)
        where = f" (its logs: {logs})" if logs else ""
        return RankFailedError(f"rank {self.rank} failed: {self.message}{where}")

    @property
    def lost_peer(self) -> str | None:
        """The address of the peer whose going away this error was (gloo names it), or None."""
        found = _PEER_GONE.search(self.message)
        return found.group(1) if found else None


def _roots(run_dir: str | Path) -> list[Path]:
    """Where records go: the run dir's logs, and where a rank that cannot write there (its disk
    is full) puts its record instead: a directory of this run dir's under the temp dir."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return [Path(run_dir) / FAILURES_DIR, Path(tempfile.gettempdir()) / "dtf-failures" / digest]


def _attempt_dir(root: Path, attempt: int) -> Path:
    return root / f"attempt_{attempt}"


def no_space_left(error: BaseException, run_dir: str | Path) -> UserError | None:
    """A write that failed for a full disk (TensorBoard's event file, model.pt, summary.json, ...)
    as one line naming the run directory's device and the way out; None for any other error. A
    failed checkpoint save says more (dtf.train.checkpoint)."""
    if not out_of_space(error, Path(run_dir)):
        return None
    return UserError(
        f"no space left on the device of {run_dir}: free space there, or put the run directory on a larger "
        "disk (hydra.run.dir); the same command then continues from the newest checkpoint"
    )


def record(run_dir: str | Path, rank: int, attempt: int, error: BaseException) -> RankFailure:
    """In a rank, as it fails: keep why (atomically: a peer's kill may follow at once). Where the
    record cannot be written (a full disk), the rank says why on its stderr instead."""
    user = user_error_in(error)
    failed = isinstance(error, TrainingFailed | RankFault)  # told in one line, without a traceback
    cause = _first_cause(error)
    text = str(cause).strip()
    message = f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
    if user or failed:
        message = str(user or error)
    every_rank = bool(getattr(user or error, "every_rank", False))
    trace = "" if failed else traceback.format_exc()
    failure = RankFailure(rank, time.time_ns(), user is not None, message, trace, every_rank)
    problem = write(run_dir, attempt, failure)
    if problem is not None:
        with contextlib.suppress(OSError):  # stderr may be a log file on the same full disk
            sys.stderr.write(f"dtf: rank {rank} failed ({message}) and could not record it ({problem})\n")
            sys.stderr.flush()
    return failure


def write(run_dir: str | Path, attempt: int, failure: RankFailure) -> OSError | None:
    """Keeps a failure record (a rank's own, or the driver's about a rank: a stalled one); the
    error when it could be written nowhere."""
    problem = None
    for root in _roots(run_dir):
        path = _attempt_dir(root, attempt) / f"rank_{failure.rank}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps(asdict(failure)))
            return None
        except OSError as e:
            problem = e
    return problem


def _first_cause(error: BaseException) -> BaseException:
    """torch.distributed.checkpoint wraps what went wrong on each rank in one CheckpointException
    (a BaseException): the lowest rank's own error says what it was."""
    wrapped = getattr(error, "failures", None)
    if isinstance(wrapped, dict) and wrapped:
        inner = wrapped[min(wrapped)]
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            return inner[0]
    return error


def newest_attempt(run_dir: str | Path) -> int | None:
    """The newest attempt any rank recorded a failure in."""
    attempts = [int(p.name.removeprefix("attempt_")) for root in _roots(run_dir) for p in root.glob("attempt_*")]
    return max(attempts, default=None)


def recorded(run_dir: str | Path, attempt: int | None = None) -> dict[int, RankFailure]:
    """Every rank's record, in the given attempt (default: the newest one recorded)."""
    roots = _roots(run_dir)
    attempt = newest_attempt(run_dir) if attempt is None else attempt
    if attempt is None:
        return {}
    found = {}
    for root in reversed(roots):  # the run dir's record of a rank wins
        for path in _attempt_dir(root, attempt).glob("rank_*.json"):
            try:
                failure = RankFailure(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # half a record: its rank was killed while writing it
            found[failure.rank] = failure
    return found


def first(run_dir: str | Path, attempt: int | None = None) -> RankFailure | None:
    """The failure that came first, in the given attempt (default: the newest one recorded)."""
    return oldest(recorded(run_dir, attempt))


def blamed(run_dir: str | Path) -> RankFailure | None:
    """What the driver reports, on every launcher: the failure that came first; but where that was a
    collective that timed out, the rank that got least far (the fewest heartbeat marks), where one
    did: the first rank to fail only waited for it (a hang in its forward, its data)."""
    attempt = newest_attempt(run_dir)
    failure = first(run_dir, attempt)
    timed_out = _TIMED_OUT.search(failure.message) if failure is not None else None
    if failure is None or timed_out is None:
        return failure
    beats = {}
    for path in (Path(run_dir) / heartbeat.HEARTBEAT_DIR).glob("rank_*.json"):
        beat = heartbeat.read(path)
        if beat is not None and beat.attempt == attempt:
            beats[beat.rank] = beat
    least = min((b.marks for b in beats.values()), default=0)
    behind = sorted(r for r, b in beats.items() if b.marks == least)
    if failure.rank not in beats or failure.rank in behind:  # it got least far itself, or all stand together
        return failure
    rank, beat = behind[0], beats[behind[0]]
    waited = ", ".join(str(r) for r in sorted(beats) if r not in behind)
    ms = next((int(g) for g in timed_out.groups() if g), None)
    limit = f"trainer.dist_timeout_s: {ms / 1000:g} s" if ms else "trainer.dist_timeout_s"
    message = (
        f"made no progress in {beat.phase} of step {beat.step + 1} while rank(s) {waited} waited for it, until the "
        f"collective timeout ({limit}) ended the run (rank {failure.rank}: {failure.message})"
    )
    return RankFailure(rank, failure.time_ns, False, message, "")


def oldest(records: dict[int, RankFailure]) -> RankFailure | None:
    return min(records.values(), key=lambda f: f.time_ns, default=None)


def clear(run_dir: str | Path) -> None:
    """On the driver, before the ranks start: an earlier run in this run dir does not get the blame,
    by its failures or by its ranks' heartbeats."""
    for root in _roots(run_dir):
        for path in sorted(root.glob("attempt_*/rank_*.json")):
            path.unlink(missing_ok=True)
    for path in (Path(run_dir) / heartbeat.HEARTBEAT_DIR).glob("rank_*.json"):
        path.unlink(missing_ok=True)


def report(failure: RankFailure, logs: str | None = None) -> UserError:
    """The error to raise on the driver; a failure that is not the user's shows its traceback first."""
    if not failure.user_error and failure.traceback.strip():
        sys.stderr.write(f"--- traceback of rank {failure.rank} ---\n{failure.traceback.rstrip()}\n")
        sys.stderr.flush()
    return failure.error(logs)
