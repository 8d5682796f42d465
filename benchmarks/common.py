"""What the benchmarks share: one dtf run as a user starts it, read back from its summary.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def dtf_summary(run_dir: Path, overrides: list[str]) -> dict:
    """Runs `python -m dtf <overrides>` in run_dir and returns its summary.json."""
    cmd = [sys.executable, "-m", "dtf", *overrides, f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())
