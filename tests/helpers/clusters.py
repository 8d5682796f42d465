"""Real local clusters for launcher tests, brought up by the project's own scripts.

A cluster that cannot be started fails these tests, so a green `make test` (which CI runs as
it is) proves the launchers. On a machine where that cannot work (no root for apt, no Java),
a user may set DTF_SKIP_CLUSTER_TESTS=1: the tests are then skipped, each saying why."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def unavailable(why: str) -> None:
    if os.environ.get("DTF_SKIP_CLUSTER_TESTS") == "1":
        pytest.skip(f"{why}; skipped because DTF_SKIP_CLUSTER_TESTS=1 (unset it to run them)")
    pytest.fail(f"{why} (set DTF_SKIP_CLUSTER_TESTS=1 to skip the cluster tests on a machine that cannot run them)")


def run_script(
    script: str, command: str, env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """`scripts/<script> <command>`, with env added to this process's environment."""
    return subprocess.run(
        ["bash", str(SCRIPTS / script), command],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@contextmanager
def script_cluster(script: str, export: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Runs `<script> start` (with env added, e.g. another state dir), yields the value it exports
    (e.g. SLURM_CONF), and stops the cluster at the end only if this call started it."""
    started = run_script(script, "start", env)
    lines = [line for line in started.stdout.splitlines() if line.startswith(f"export {export}=")]
    if started.returncode != 0 or not lines:
        unavailable(f"scripts/{script} start failed: {started.stderr.strip()[-500:]}")
    value = lines[-1].split("=", 1)[1]
    try:
        yield value
    finally:
        if "already running" not in started.stderr:
            run_script(script, "stop", env, timeout=120)
