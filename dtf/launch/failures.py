"""Turns a failed rank (as torch elastic reports it) into the one line a user reads."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, get_error_handler

from dtf.errors import UserError

# A rank that hit a UserError exits with this code after recording the message, without a traceback.
EXIT_USER_ERROR = 2


def record_user_error(e: UserError) -> None:
    """Called in a rank: hand the message to the agent through torch elastic's error file."""
    get_error_handler().record_exception(e)


def _message_and_stack(message: Any) -> tuple[str, str]:
    if isinstance(message, dict):
        return str(message.get("message", "")), str(message.get("extraInfo", {}).get("py_callstack", ""))
    return str(message), ""


def _root_cause(e: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The failure that came first. Elastic's own pick compares whole-second timestamps, so a
    peer that died of the first rank's crash ("connection closed by peer") ties with it; the
    error files' modification times (ns) order them. A rank killed by a signal writes no error
    file and counts as first: its peers' errors are the consequence."""

    def order(item: tuple[int, ProcessFailure]) -> tuple[int, int]:
        _, failure = item
        try:
            return (1, os.stat(failure.error_file).st_mtime_ns)
        except OSError:
            return (0 if failure.exitcode < 0 else 2, 0)

    return min(e.failures.items(), key=order)


def describe_failure(e: ChildFailedError, run_dir: str) -> str:
    rank, failure = _root_cause(e)
    text, stack = _message_and_stack(failure.message)
    prefix = f"{UserError.__name__}: "
    if text.startswith(prefix):
        return f"{text[len(prefix) :]} (rank {rank})"
    if stack:
        # The ranks' tracebacks are recorded, not printed (rank 0's too): the first failing rank's is
        # shown here, the same way whichever rank it is.
        sys.stderr.write(f"--- traceback of rank {rank} ---\n{stack.rstrip()}\n")
    if failure.exitcode < 0:
        text = text or f"killed by signal {-failure.exitcode}"
    reason = text or f"exit code {failure.exitcode}"
    logs = os.path.dirname(failure.error_file) if os.path.isabs(failure.error_file) else f"{run_dir}/logs"
    return f"rank {rank} failed: {reason} (exit code {failure.exitcode}; its logs: {logs})"


def previous_attempt_failure() -> str:
    """In a rank the elastic agent restarted: which rank failed in the attempt before, and why, from
    the error files elastic keeps per attempt (<logs>/attempt_<k>/<rank>/error.json); the first to
    fail (by the files' times) is the cause, the others' errors its consequence."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    own = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if attempt == 0 or not own:
        return "a rank failed"
    previous = Path(own).parent.parent.with_name(f"attempt_{attempt - 1}")
    found = []
    for path in previous.glob("*/error.json"):
        try:
            message, _ = _message_and_stack(json.loads(path.read_text()).get("message"))
            found.append((path.stat().st_mtime_ns, int(path.parent.name), message))
        except (OSError, ValueError):
            continue
    if not found:
        return "a rank died without an error of its own (killed by a signal?)"
    _, rank, message = min(found)
    return f"rank {rank} failed ({message.strip().splitlines()[0] if message.strip() else 'no message'})"
