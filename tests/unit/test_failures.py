"""Which rank the driver blames when several ranks of a run fail (dtf.launch.local.failed_rank)."""

from __future__ import annotations

import signal
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from dtf import failures
from dtf.launch.local import failed_rank


def _record(run_dir: Path, rank: int, message: str) -> None:
    try:
        raise RuntimeError(message)
    except RuntimeError as error:
        failures.record(run_dir, rank, attempt=0, error=error)


def _child_failed(**exitcodes: int) -> ChildFailedError:
    """What the agent reports: the ranks it saw fail, with their exit codes (negative: a signal)."""
    ranks = {int(r.removeprefix("rank")): code for r, code in exitcodes.items()}
    return ChildFailedError("fn", {r: ProcessFailure(r, 1000 + r, code, "<N/A>") for r, code in ranks.items()})


def test_a_rank_that_recorded_its_error_and_then_aborted_on_its_way_out_is_not_blamed(tmp_path: Path) -> None:
    # Rank 0 raises; rank 1 loses its peer in a collective and records that, then aborts as the
    # process exits with gloo's threads alive ("terminate called without an active exception").
    _record(tmp_path, 0, "injected failure on rank 0")
    _record(tmp_path, 1, "Connection closed by peer [127.0.0.1]:6282")
    error = failed_rank(_child_failed(rank1=-signal.SIGABRT), str(tmp_path))
    assert str(error).startswith("rank 0 failed: RuntimeError: injected failure on rank 0"), error


def test_a_rank_killed_before_it_could_record_anything_is_blamed_over_its_peers(tmp_path: Path) -> None:
    # Rank 1 was killed (the OOM killer's SIGKILL): rank 0's error is the consequence.
    _record(tmp_path, 0, "Connection reset by peer")
    error = failed_rank(_child_failed(rank0=1, rank1=-signal.SIGKILL), str(tmp_path))
    assert str(error).startswith("rank 1 failed: killed by signal SIGKILL"), error


def test_a_rank_that_died_before_dtf_ran_in_it_is_told_where_its_output_is(tmp_path: Path) -> None:
    # No record and no error file: it died while starting (a script run again in it, say). Rank 1's
    # stderr is a file of the run's logs; rank 0's goes to the terminal, above the error line.
    stderr = tmp_path / "logs" / "a1b2c3_x" / "attempt_0" / "1" / "stderr.log"
    stderr.parent.mkdir(parents=True)
    stderr.write_text("Traceback ...\n")
    error = failed_rank(_child_failed(rank1=1), str(tmp_path))
    assert str(error) == f"rank 1 failed with exit code 1 (its error output: {stderr})"
    assert (
        str(failed_rank(_child_failed(rank0=1), str(tmp_path)))
        == "rank 0 failed with exit code 1 (its output is above)"
    )
