"""Real local clusters for launcher tests, brought up by the project's own scripts.

In CI (CI set) a cluster that cannot be started fails the tests; elsewhere they are skipped
with the reason (e.g. not root, no apt)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def unavailable(why: str) -> None:
    if in_ci():
        pytest.fail(f"{why} (CI must run these tests)")
    pytest.skip(f"{why}; outside CI these tests are skipped")


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
