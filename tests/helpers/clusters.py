"""Real local clusters for launcher tests, brought up by the project's own scripts.

A cluster that cannot be started fails these tests, so a green `make test` (which CI runs as
it is) proves the launchers. On a machine where that cannot work (no root for apt, no Java),
a user may set DTF_SKIP_CLUSTER_TESTS=1: the tests are then skipped, each saying why."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def unavailable(why: str) -> NoReturn:
    skip_if_asked(why, "DTF_SKIP_CLUSTER_TESTS", "the cluster tests on a machine that cannot run them")


def skip_if_asked(why: str, variable: str, what: str) -> NoReturn:
    """Skip, saying why, where the user set `variable`=1 on their own machine; else fail. Under CI
    (the CI variable that CI services set) the variable is not heeded: there these tests must run."""
    in_ci = os.environ.get("CI", "").lower() not in ("", "0", "false")
    if os.environ.get(variable) == "1" and not in_ci:
        pytest.skip(f"{why}; skipped because {variable}=1 (unset it to run them)")
    hint = f"{variable}=1 is not heeded under CI" if in_ci else f"set {variable}=1 to skip {what}"
    pytest.fail(f"{why} ({hint})")


def run_script(
    script: str, command: str, env: dict[str, str] | None = None, timeout: float = 900, args: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """`scripts/<script> <command> <args>`, with env added to this process's environment."""
    return subprocess.run(
        ["bash", str(SCRIPTS / script), command, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@contextmanager
def script_cluster(
    script: str, export: str, env: dict[str, str] | None = None, args: Sequence[str] = ()
) -> Iterator[str]:
    """Runs `<script> start <args>` (with env added, e.g. another state dir), yields the value it
    exports (e.g. SLURM_CONF), and stops the cluster at the end only if this call started it."""
    started = run_script(script, "start", env, args=args)
    lines = [line for line in started.stdout.splitlines() if line.startswith(f"export {export}=")]
    if started.returncode != 0 or not lines:
        unavailable(f"scripts/{script} start failed: {started.stderr.strip()[-500:]}")
    value = lines[-1].split("=", 1)[1]
    try:
        yield value
    finally:
        if "already running" not in started.stderr:
            run_script(script, "stop", env, timeout=120)


def preempt_and_requeue(
    cmd: list[str], run_dir: Path, out: Path, on_cluster: Callable[[list[str]], list[str]] = lambda c: c
) -> str:
    """Starts `python -m dtf ... launcher=slurm` (cmd) into run_dir, sends its job what SLURM sends
    before a preemption (scancel --signal=USR1) once it trains, lets the requeued job start at once,
    and waits for the driver to end (exit 0 required). on_cluster: how a SLURM command reaches the
    controller (as it is, or on a host of scripts/local-hosts.sh). Returns the driver's output."""
    import time

    from tests.helpers.run_command import start_command

    with start_command([*cmd, f"hydra.run.dir={run_dir}"], out) as proc:
        deadline = time.monotonic() + 180
        while "rank(s), strategy=" not in out.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1.5)
        preempt(proc, out, on_cluster, deadline)
        proc.finish(0, timeout=300)
    return out.read_text()


def preempt(
    proc: subprocess.Popen[bytes], out: Path, on_cluster: Callable[[list[str]], list[str]], deadline: float
) -> None:
    """Sends the job whose driver (proc) writes to out what SLURM sends before a preemption, waits
    for the requeue and lets the requeued job start at once."""
    import re
    import time

    job = re.search(r"submitted SLURM job (\d+)", out.read_text())
    assert job, out.read_text()
    # what SLURM sends before preemption or the time limit (launcher.signal)
    subprocess.run(on_cluster(["scancel", "--signal=USR1", job.group(1)]), check=True)
    while "requeued SLURM job" not in out.read_text() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    start_requeued(job.group(1), on_cluster)


def start_requeued(job: str, on_cluster: Callable[[list[str]], list[str]], timeout: float = 60) -> None:
    """Lets a job that was requeued start as soon as it is pending again (once its nodes have
    let go of it)."""
    import time

    # SLURM holds a requeued job for ~2 minutes before it is eligible again; the test does not wait
    # that out. Not within the second of the requeue either: slurmd refuses a credential issued in
    # the second its job's old one was revoked ("Job credential revoked"), and the job would fail.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run(on_cluster(["squeue", "-h", "-j", job, "-o", "%T"]), capture_output=True, text=True)
        if state.stdout.strip() == "PENDING":
            time.sleep(1.1)
            subprocess.run(on_cluster(["scontrol", "update", f"JobId={job}", "StartTime=now"]), check=True)
            return
        if state.stdout.strip() == "RUNNING":
            return
        time.sleep(0.2)
    raise AssertionError(f"SLURM job {job} was not pending again within {timeout} s")
