"""Which ranks the driver takes for stalled, and when (dtf.launch.stalls), on heartbeats it is given;
which rank it blames when a collective timed out first (dtf.failures.blamed)."""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, replace
from pathlib import Path

from dtf import failures, heartbeat
from dtf.heartbeat import Beat
from dtf.launch.stalls import STALL_FLOOR_S, StallWatch

HOST = socket.gethostname()


def _beat(rank: int, marks: int, phase: str = "forward", **kw: object) -> Beat:
    # pids that are not this process's children: nothing is killed here
    fields: dict[object, object] = dict(pid=10**7 + rank, host=HOST, attempt=0, step=9, first_step_done=True)
    return Beat(rank=rank, marks=marks, phase=phase, step_s=0.01, **{**fields, **kw})  # type: ignore[arg-type]


def test_the_rank_that_got_the_least_far_is_the_stalled_one_once_nothing_moved_for_the_timeout(
    tmp_path: Path,
) -> None:
    watch = StallWatch(tmp_path, timeout_s=3, collective_timeout_s=600)
    beats = {0: _beat(0, 41, "backward"), 1: _beat(1, 40)}
    assert not watch.check(beats, now=100.0)
    assert not watch.check(beats, now=102.9)
    assert watch.check(beats, now=103.0)
    assert list(failures.recorded(tmp_path)) == [1]
    assert failures.first(tmp_path).error().args[0] == (  # type: ignore[union-attr]
        "rank 1 failed: made no progress for 3 s in forward of step 10 (trainer.stall_timeout_s: 3 s), while rank(s) 0 "
        "waited for it; it was killed"
    )


def test_progress_on_any_rank_restarts_the_clock(tmp_path: Path) -> None:
    watch = StallWatch(tmp_path, timeout_s=3, collective_timeout_s=600)
    assert not watch.check({0: _beat(0, 41), 1: _beat(1, 40)}, now=100.0)
    assert not watch.check({0: _beat(0, 42), 1: _beat(1, 40)}, now=102.0)
    assert not watch.check({0: _beat(0, 42), 1: _beat(1, 40)}, now=104.5)
    assert watch.check({0: _beat(0, 42), 1: _beat(1, 40)}, now=105.0)


def test_ranks_all_at_the_same_point_are_all_named_without_blaming_one(tmp_path: Path) -> None:
    watch = StallWatch(tmp_path, timeout_s=3, collective_timeout_s=600)
    beats = {0: _beat(0, 40), 1: _beat(1, 40)}
    watch.check(beats, now=0.0)
    assert watch.check(beats, now=3.0)
    error = failures.first(tmp_path).error()  # type: ignore[union-attr]
    assert str(error).startswith("no rank made progress for 3 s (trainer.stall_timeout_s: 3 s); every rank was in ")


def test_start_up_and_checkpoints_get_the_collective_timeout_and_the_default_follows_the_step_time(
    tmp_path: Path,
) -> None:
    watch = StallWatch(tmp_path, timeout_s=None, collective_timeout_s=1800)
    running = {0: _beat(0, 41), 1: _beat(1, 40)}
    assert watch.allowance(running) == STALL_FLOOR_S == 300
    assert watch.allowance({r: replace(b, step_s=20.0) for r, b in running.items()}) == 50 * 20.0
    assert watch.allowance({0: running[0], 1: replace(running[1], first_step_done=False)}) == 1800
    assert watch.allowance({0: running[0], 1: replace(running[1], phase="saving a checkpoint")}) == 1800
    assert StallWatch(tmp_path, timeout_s=3, collective_timeout_s=60).allowance(running) == 3


def _timed_out(tmp_path: Path, rank: int, attempt: int = 0) -> None:
    error = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation")
    failures.write(tmp_path, attempt, failures.RankFailure(rank, 1, False, f"RuntimeError: {error}", "Traceback"))


def _beating(tmp_path: Path, *beats: Beat) -> None:
    for beat in beats:
        path = heartbeat.path_of(tmp_path, beat.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(beat)))


def test_a_collective_timeout_blames_the_rank_that_got_least_far_not_the_one_whose_wait_ran_out(
    tmp_path: Path,
) -> None:
    _timed_out(tmp_path, rank=0)
    _beating(tmp_path, _beat(0, 41, "backward"), _beat(1, 40, "forward"), _beat(2, 41, "backward"))
    blamed = failures.blamed(tmp_path)
    assert blamed is not None and blamed.rank == 1 and not blamed.traceback
    assert blamed.error().args[0] == (
        "rank 1 failed: made no progress in forward of step 10 while rank(s) 0, 2 waited for it, until the collective "
        "timeout (trainer.dist_timeout_s: 20 s) ended the run (rank 0: RuntimeError: [gloo/transport/tcp/"
        "unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation)"
    )


def test_a_collective_timeout_where_no_rank_is_behind_or_of_another_attempt_blames_the_rank_that_failed(
    tmp_path: Path,
) -> None:
    _timed_out(tmp_path, rank=0)
    _beating(tmp_path, _beat(0, 41), _beat(1, 41))  # every rank at the same point
    assert failures.blamed(tmp_path).rank == 0  # type: ignore[union-attr]
    _beating(tmp_path, _beat(1, 40, attempt=1))  # a restarted rank's heartbeat: not this attempt's
    assert failures.blamed(tmp_path).rank == 0  # type: ignore[union-attr]
    failures.clear(tmp_path)  # and a new run clears both
    assert failures.blamed(tmp_path) is None and not list((tmp_path / heartbeat.HEARTBEAT_DIR).glob("*.json"))
