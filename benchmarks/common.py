"""What the benchmarks share: one dtf run as a user starts it, read back from its summary.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def dtf_summary(run_dir: Path, overrides: list[str], checkout: Path | None = None) -> dict:
    """Runs `python -m dtf <overrides>` in run_dir and returns its summary.json. checkout: the
    dtf to run (default: this one), e.g. a `git worktree` of another commit for an A/B. The run
    starts outside any checkout: `python -m` puts its working directory first on sys.path."""
    if checkout is not None:
        own_configs(checkout)
    env = {**os.environ, "PYTHONPATH": str(checkout or REPO)}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dtf", *overrides, f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=run_dir.parent, env=env)
    return json.loads((run_dir / "summary.json").read_text())


def own_configs(checkout: Path) -> None:
    """dtf finds its configs as the packages dtf.conf and dtf.recipes, which the venv's editable
    install maps to this checkout's conf/ and recipes/: another checkout's dtf would compose this
    one's configs (and fail on any target they name that it lacks). Links beside its code make it
    find its own."""
    for name in ("conf", "recipes"):
        link = checkout / "dtf" / name
        if not link.exists():
            link.symlink_to(checkout / name)
