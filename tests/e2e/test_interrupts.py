"""Signals that are not stop requests end a run as interrupted, never as a clean stop (exit 75
invites a requeue); a rank that crashes is reported as a crash, whatever came before it."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.run_command import TEST_DEFAULTS, dtf_command, dtf_env, run_dtf, start_command
from tests.helpers.sockets import descendants

# A long run whose every forward sleeps: a signal always lands in the middle of training.
SLOW = [
    "model._target_=user_models.FailingModel",
    "+model.fail_rank=-1",
    "+model.delay_s=0.02",
    "trainer.max_steps=5000",
    "trainer.log_every_n_steps=10",
    "checkpoint.every_n_steps=20",
]


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _interrupt(
    tmp_path: Path, sig: signal.Signals, *, group: bool, args: tuple[str, ...] = (), every: bool = False
) -> tuple[int, str]:
    """Starts dtf in a session of its own, sends sig once it trains (to its process group, as a
    terminal's Ctrl-C does; with every=True to every process it started, ranks and data workers
    included, as SLURM does; or to the driver only), and returns (exit status, stderr)."""
    log = tmp_path / "log"
    cmd = dtf_command(*TEST_DEFAULTS, *SLOW, *args, f"hydra.run.dir={tmp_path / 'run'}")
    with start_command(cmd, log, err=tmp_path / "err", new_session=True) as proc:
        deadline = time.monotonic() + 120
        while "step 40/" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "err").read_text()[-2000:]
        if every:
            _signal_all([proc.pid, *descendants(proc.pid)], sig)
        elif group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        ranks = descendants(proc.pid)  # in sessions of their own: a kill of the driver's group misses them
        try:
            code = proc.finish(expect=None, timeout=90)
        finally:
            if proc.poll() is None:
                _signal_all([proc.pid, *descendants(proc.pid)], signal.SIGKILL)
            _signal_all(ranks, signal.SIGKILL)  # none left, unless the driver died before them
    return code, (tmp_path / "err").read_text()


@pytest.mark.parametrize(
    ("sig", "group", "args"),
    [
        (signal.SIGINT, True, ()),  # Ctrl-C in a terminal: the whole foreground process group
        (signal.SIGHUP, False, ()),
        (signal.SIGQUIT, False, ()),
        (signal.SIGTERM, False, ("checkpoint.stop_signals=[]",)),  # not a stop signal here
    ],
)
def test_a_signal_that_is_not_a_stop_request_ends_the_run_as_interrupted(
    tmp_path: Path, sig: signal.Signals, group: bool, args: tuple[str, ...]
) -> None:
    code, err = _interrupt(tmp_path, sig, group=group, args=args)
    assert code == 128 + sig.value, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"dtf: interrupted by {sig.name}"), err[-2000:]
    assert "stopped by" not in err and "Traceback" not in err
    assert not (tmp_path / "run" / "summary.json").exists()


def test_ctrl_c_leaves_nothing_to_print_after_the_run_has_ended(tmp_path: Path) -> None:
    # The ranks' DataLoader workers hold semaphores, registered with the resource tracker the driver
    # started; ranks killed by the agent leave them to it, and it cleans them up once the driver has
    # ended (after the shell's prompt) with a warning per run: "leaked semaphore objects".
    log, err = tmp_path / "log", tmp_path / "err"
    cmd = dtf_command(*TEST_DEFAULTS, *SLOW, "data.num_workers=2", f"hydra.run.dir={tmp_path / 'run'}")
    with start_command(cmd, log, err=err, new_session=True) as proc:
        deadline = time.monotonic() + 120
        while "step 40/" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        below = descendants(proc.pid)  # the ranks, their workers, the resource tracker
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.finish(128 + signal.SIGINT, timeout=90)
            deadline = time.monotonic() + 30  # what outlives the driver has ended, and printed what it would
            while any(Path(f"/proc/{pid}").exists() for pid in below) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            _signal_all([proc.pid, *below], signal.SIGKILL)
    lines = err.read_text().strip().splitlines()
    assert lines[-1].startswith("dtf: interrupted by SIGINT"), lines[-5:]
    assert "leaked" not in err.read_text() and "Traceback" not in err.read_text(), err.read_text()[-2000:]


def test_a_rank_that_crashes_after_a_stop_signal_is_reported_as_a_crash(tmp_path: Path) -> None:
    # rank 1 sends SIGTERM (a stop request) to the launcher, then raises at its next forward
    run = run_dtf(
        [
            "model._target_=user_models.FailingModel",
            "+model.fail_at_call=30",
            "+model.how=agent:SIGTERM",
            "+model.raise_after_signal=true",
            "trainer.max_steps=200",
        ],
        tmp_path / "run",
        expect=1,
    )
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("dtf: error: rank 1 failed: RuntimeError: injected failure on rank 1 after a stop"), last


# Each kind of worker process with one of the two stop signals (the workers ignore every stop signal alike).
@pytest.mark.parametrize(
    ("args", "sig"),
    [
        (("data.num_workers=2",), signal.SIGTERM),  # DataLoader worker processes
        (("data=petastorm", "data.reader_pool_type=process"), signal.SIGUSR1),  # Petastorm's readers (path below)
    ],
)
def test_a_stop_signal_to_every_process_stops_cleanly_with_worker_processes(
    tmp_path: Path, args: tuple[str, ...], sig: signal.Signals
) -> None:
    # What torchrun and Kubernetes (SIGTERM) and SLURM (its warning signal) do: signal every process,
    # data workers included.
    if "data=petastorm" in args:
        from tests.helpers.parquet_files import write_row_groups

        data = write_row_groups(tmp_path / "data", [[2000, 2000]])
        args = (
            *args,
            f"data.path={data}",
            "data.feature_columns=[features]",
            "data.label_column=x",
            "model.in_features=2",
        )
    code, err = _interrupt(tmp_path, sig, group=True, args=args, every=True)
    assert code == 75, err[-3000:]
    assert f"dtf: stopped by {sig.name} at step" in err.strip().splitlines()[-1], err[-3000:]


def test_a_closed_terminal_ends_the_run_as_interrupted_by_sighup(tmp_path: Path) -> None:
    # The terminal's hangup: SIGHUP to its session, and stderr gone with it (a write there fails
    # with EIO), where the line above sends SIGHUP with stderr in a file. The run ended with 1.
    import pty

    cmd = dtf_command(*TEST_DEFAULTS, *SLOW, f"hydra.run.dir={tmp_path / 'run'}")
    env = dtf_env()
    pid, terminal = pty.fork()
    if pid == 0:  # the child: dtf on the terminal, as a user starts it
        os.execve(cmd[0], cmd, env)
    seen, deadline = b"", time.monotonic() + 120
    with contextlib.suppress(OSError):
        while b"step 40/" not in seen and time.monotonic() < deadline:
            seen += os.read(terminal, 4096)
    ranks = descendants(pid)
    try:
        os.close(terminal)  # the terminal window closes
        code = _exit_status_within(pid, 90)
    finally:
        _signal_all([pid, *descendants(pid), *ranks], signal.SIGKILL)
    assert code == 128 + signal.SIGHUP.value, seen.decode(errors="replace")[-2000:]
    assert not (tmp_path / "run" / "summary.json").exists()


def _exit_status_within(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None
