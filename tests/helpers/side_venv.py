"""A venv of its own for Hydra's Optuna sweeper, made once and then reused.

hydra-optuna-sweeper 1.3.0 (the newest) needs optuna<3 (2.10.1), whose sqlite storage needs
SQLAlchemy<2, while dtf's venv has optuna 5 and SQLAlchemy 2: the two cannot share a venv. This
side venv holds only what must differ and sees the main venv for everything else (torch, hydra,
dtf as installed there), so nothing big is installed twice:

- `python -m venv --without-pip` from the main venv's base interpreter;
- `pip install --no-deps` of SIDE_PACKAGES into it, with the main venv's pip, before the main venv
  is visible to it: pip neither sees nor touches the main venv's packages;
- a .pth file that adds the main venv's site-packages (with its own .pth files: the editable dtf)
  *after* the side venv's own, so the side's optuna 2.10 shadows the main venv's;
- a stamp naming what was installed: the next call returns at once; a different list (or a
  half-made venv, after an interrupted first call) makes it anew.

Where: `<main venv>/side/hydra-optuna` (so `make clean-venv` removes it with the main venv), or
under $DTF_SIDE_VENVS when set. `python tests/helpers/side_venv.py` makes it and prints its python.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

NAME = "hydra-optuna"
# hydra-optuna-sweeper's own pins (optuna<3 -> 2.10.1, which needs SQLAlchemy<2), and what
# optuna 2.10 imports that the main venv has in a version it cannot use (alembic 1.20 needs
# SQLAlchemy 2; 1.19.2 is the newest that takes 1.4) or lacks (cmaes, imported by optuna.samplers).
# Not cliff: only optuna's own command line (optuna.cli) imports it.
SIDE_PACKAGES = [
    "hydra-optuna-sweeper==1.3.0",
    "optuna==2.10.1",
    "sqlalchemy<2",
    "alembic==1.19.2",
    "cmaes==0.13.1",
]
PTH_FILE = "_dtf_main_venv.pth"
STAMP_FILE = "dtf-side-venv.json"
# What must come from the side venv, and what from the main one, for the venv to be right.
CHECK = (
    "import optuna, sqlalchemy, hydra, torch, dtf, hydra_plugins.hydra_optuna_sweeper.optuna_sweeper; "
    "assert optuna.__version__ == '2.10.1', optuna.__version__; "
    "assert sqlalchemy.__version__.startswith('1.'), sqlalchemy.__version__; "
    "print(optuna.__file__, torch.__file__, dtf.__file__)"
)


class SideVenvError(RuntimeError):
    """The side venv could not be made (no network to the package index, most often)."""


def main_site_packages() -> list[str]:
    """The running (main) venv's site-packages directories."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def default_dir() -> Path:
    if os.environ.get("DTF_SIDE_VENVS"):
        return Path(os.environ["DTF_SIDE_VENVS"]) / NAME
    if sys.prefix == sys.base_prefix:
        raise SideVenvError("not running in a venv: set DTF_SIDE_VENVS to a directory for the side venvs")
    return Path(sys.prefix) / "side" / NAME


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure(venv: Path | None = None, packages: list[str] = SIDE_PACKAGES) -> Path:
    """Makes the side venv if it is not there (or not as wanted); returns its python."""
    venv = venv or default_dir()
    wanted = {"packages": packages, "main_site_packages": main_site_packages(), "base": base_python()}
    stamp = venv / STAMP_FILE
    if _read(stamp) == wanted:
        return python_of(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:  # two test processes at once: one makes it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read(stamp) == wanted:
            return python_of(venv)
        shutil.rmtree(venv, ignore_errors=True)
        _make(venv, packages)
        stamp.write_text(json.dumps(wanted, indent=2) + "\n")  # last: its presence means complete
    return python_of(venv)


def base_python() -> str:
    return str(getattr(sys, "_base_executable", None) or sys.executable)


def _make(venv: Path, packages: list[str]) -> None:
    _run([base_python(), "-m", "venv", "--without-pip", str(venv)], "python -m venv")
    python = python_of(venv)
    # The main venv's pip, run under the side venv's python (pip --python): it installs into the
    # side venv and sees only that venv's (empty) site-packages, since the .pth is not there yet.
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-input", "-q", *packages],
        "pip install " + " ".join(packages),
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # site.addsitedir, not a bare path line: it also runs the main venv's .pth files (an editable
    # install's finder), and it appends, so the side venv's own packages come first.
    lines = [f"import site; site.addsitedir({p!r})" for p in main_site_packages()]
    (Path(site) / PTH_FILE).write_text("\n".join(lines) + "\n")
    _run([str(python), "-c", CHECK], "the side venv's imports")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SideVenvError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _read(stamp: Path) -> object:
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    print(ensure())
