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


@contextmanager
def script_cluster(script: str, export: str) -> Iterator[str]:
    """Runs `<script> start`, yields the value it exports (e.g. SLURM_CONF), and stops the
    cluster at the end only if this call started it."""
    started = subprocess.run(["bash", str(SCRIPTS / script), "start"], capture_output=True, text=True, timeout=900)
    lines = [line for line in started.stdout.splitlines() if line.startswith(f"export {export}=")]
    if started.returncode != 0 or not lines:
        unavailable(f"scripts/{script} start failed: {started.stderr.strip()[-500:]}")
    value = lines[-1].split("=", 1)[1]
    try:
        yield value
    finally:
        if "already running" not in started.stderr:
            subprocess.run(["bash", str(SCRIPTS / script), "stop"], capture_output=True, timeout=120)
