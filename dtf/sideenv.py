"""Side environments: venvs of their own for tools that cannot share dtf's.

    python -m dtf.sideenv NAME      makes it (once; anew when its pins change) and prints its python

Each is pinned by the dtf extra of the same name (pyproject.toml), read here from dtf's installed
metadata, so the pins live in one place:

- hydra-optuna: Hydra's Optuna sweeper. hydra-optuna-sweeper 1.3.0 (the newest) needs optuna 2.10,
  whose sqlite storage needs SQLAlchemy < 2, while dtf has optuna 5 and SQLAlchemy 2. LAYERED over
  the main venv: it holds only what must differ and sees the main venv for everything else
  (torch, Hydra, dtf as installed there), so nothing big is installed twice. `python -m dtf -m
  hydra/sweeper=optuna ...` runs with its python.
- petastorm: Petastorm, to write Petastorm datasets (`python -m dtf.data.prepare --format
  petastorm`). Petastorm calls the ParquetDataset API pyarrow 15 removed, so it needs pyarrow 14,
  built for numpy 1.x, on Python <= 3.12: none of that can sit beside dtf's stack. STANDALONE: no
  torch, no dtf; dtf runs scripts in it by path (dtf/data/petastorm_writer.py) and reads what they
  write.

How a layered one is made: `python -m venv --without-pip` from the main venv's base interpreter;
the main venv's pip installs the pins with --no-deps into it (`pip --python`) before the main venv
is visible to it, so pip neither sees nor touches the main venv's packages; then a .pth file adds
the main venv's site-packages (with its own .pth files: an editable dtf) *after* the side venv's
own, so the side's packages shadow the main venv's. A standalone one is a plain venv (with its own
pip) whose pip resolves the pins and their dependencies, on the first Python in the pins' range
found: the main venv's own, else python3.12, python3.11, ... on PATH, or $DTF_SIDE_PYTHON.

Either way a stamp file names what was installed: the next call returns at once; other pins (or a
half-made venv, after an interrupted first call) make it anew. Where: `<main venv>/side/NAME`
(`make clean-venv` removes it with the main venv), or `$DTF_SIDE_VENVS/NAME` when that is set.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PTH_FILE = "_dtf_main_venv.pth"
STAMP_FILE = "dtf-side-venv.json"


@dataclass(frozen=True)
class Spec:
    name: str
    layered: bool  # sees the main venv's packages (after its own), or stands alone
    imports: tuple[str, ...]  # what must import in it for it to be right
    pythons: tuple[str, ...] = ()  # a standalone one: the Python versions its pins have wheels for
    purpose: str = ""


SPECS = {
    "hydra-optuna": Spec(
        "hydra-optuna",
        layered=True,
        imports=("optuna", "sqlalchemy", "hydra", "torch", "dtf", "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper"),
        purpose="Hydra's Optuna sweeper (python -m dtf -m hydra/sweeper=optuna)",
    ),
    "petastorm": Spec(
        "petastorm",
        layered=False,
        imports=("petastorm", "petastorm.etl.dataset_metadata", "pyspark", "pyarrow", "cv2"),
        # pyarrow 14 and numpy 1.26 have no wheels for Python 3.13
        pythons=("3.12", "3.11", "3.10"),
        purpose="writing Petastorm datasets (python -m dtf.data.prepare --format petastorm)",
    ),
}


class SideEnvError(RuntimeError):
    """A side environment could not be made (no package index or no fitting Python, most often)."""


def pins(name: str) -> list[str]:
    """The requirements of dtf's extra `name`, as dtf's installed metadata holds them."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    try:
        declared = requires("dtf") or []
    except PackageNotFoundError:
        raise SideEnvError(
            "dtf is not installed (its extras hold the side environments' pins): pip install -e . in its checkout"
        ) from None
    found = []
    for line in declared:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": name}):
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            found.append(f"{req.name}{extras}{req.specifier}")
    if not found:
        raise SideEnvError(f"dtf's metadata has no extra {name!r}: reinstall dtf (pip install -e .)")
    return found


def spec(name: str) -> Spec:
    if name not in SPECS:
        raise SideEnvError(f"no side environment {name!r}: there are {', '.join(SPECS)}")
    return SPECS[name]


def default_dir(name: str) -> Path:
    if os.environ.get("DTF_SIDE_VENVS"):
        return Path(os.environ["DTF_SIDE_VENVS"]) / name
    if sys.prefix == sys.base_prefix:
        raise SideEnvError("not running in a venv: set DTF_SIDE_VENVS to a directory for the side environments")
    return Path(sys.prefix) / "side" / name


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def main_site_packages() -> list[str]:
    """The running (main) venv's site-packages directories."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def base_python() -> str:
    """The interpreter the running venv was made from."""
    return str(getattr(sys, "_base_executable", None) or sys.executable)


def environment() -> dict[str, str]:
    """The environment to run a standalone side environment's python in: this one's, less what
    would point it at this environment's packages or interpreter (Spark's workers included)."""
    inherited = ("PYTHONPATH", "PYTHONHOME", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in inherited}


def _wanted(s: Spec) -> dict[str, object]:
    """What the stamp of a current side environment says (a standalone one's interpreter is free)."""
    wanted: dict[str, object] = {"packages": pins(s.name)}
    if s.layered:
        wanted.update(main_site_packages=main_site_packages(), base=base_python())
    return wanted


def find(name: str, venv: Path | None = None) -> Path | None:
    """The side environment's python if it is made and current, else None (nothing is made)."""
    s = spec(name)
    venv = venv or default_dir(name)
    stamp = _read(venv / STAMP_FILE)
    if not isinstance(stamp, dict) or not python_of(venv).exists():
        return None
    wanted = _wanted(s)
    return python_of(venv) if all(stamp.get(k) == v for k, v in wanted.items()) else None


def ensure(name: str, venv: Path | None = None, python: str | None = None) -> Path:
    """Makes the side environment if it is not there (or not as wanted); returns its python.
    python: the interpreter of a standalone one (default: the first that fits, see the module doc)."""
    s = spec(name)
    venv = venv or default_dir(name)
    if (found := find(name, venv)) is not None:
        return found
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:  # two test processes at once: one makes it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (found := find(name, venv)) is not None:
            return found
        shutil.rmtree(venv, ignore_errors=True)
        stamp = _wanted(s)
        if s.layered:
            _make_layered(venv, pins(name), s)
        else:
            stamp["base"] = _make_standalone(venv, pins(name), s, python)
        (venv / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")  # last: its presence means complete
    return python_of(venv)


def _make_layered(venv: Path, packages: list[str], s: Spec) -> None:
    _run([base_python(), "-m", "venv", "--without-pip", str(venv)], "python -m venv")
    python = python_of(venv)
    # The main venv's pip, run under the side venv's python (pip --python): it installs into the
    # side venv and sees only that venv's (empty) site-packages, since the .pth is not there yet.
    _pip([sys.executable, "-m", "pip", "--python", str(python)], ["--no-deps", *packages])
    # site.addsitedir, not a bare path line: it also runs the main venv's .pth files (an editable
    # install's finder), and it appends, so the side venv's own packages come first.
    lines = [f"import site; site.addsitedir({p!r})" for p in main_site_packages()]
    (Path(_purelib(python)) / PTH_FILE).write_text("\n".join(lines) + "\n")
    _check(python, packages, s)


def _make_standalone(venv: Path, packages: list[str], s: Spec, python: str | None) -> str:
    base = _interpreter(s, python)
    _run([base, "-m", "venv", str(venv)], "python -m venv", environment())
    _pip([str(python_of(venv)), "-m", "pip"], packages, environment())
    _check(python_of(venv), packages, s, environment())
    return base


def _interpreter(s: Spec, chosen: str | None) -> str:
    """The first Python whose version the pins have wheels for."""
    chosen = chosen or os.environ.get("DTF_SIDE_PYTHON")
    candidates = [chosen] if chosen else [base_python(), *(f"python{v}" for v in s.pythons)]
    for candidate in candidates:
        path = shutil.which(candidate)
        if path is None:
            continue
        try:  # a pyenv shim for a version not selected exits non-zero: not this one
            proc = subprocess.run(
                [path, "-c", "import sys; print('%d.%d' % sys.version_info[:2], sys.executable)"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        version, _, executable = proc.stdout.strip().partition(" ")
        if proc.returncode == 0 and version in s.pythons:
            return executable
    wanted = f"Python {s.pythons[-1]} to {s.pythons[0]}"
    if chosen:
        raise SideEnvError(f"the {s.name} environment needs {wanted}, and {chosen} is not one")
    raise SideEnvError(
        f"the {s.name} environment needs {wanted} (its pins have no wheels for others), and none was found "
        f"(this venv's Python, {' '.join(c for c in candidates[1:])} on PATH): install one, or name one with "
        "DTF_SIDE_PYTHON=/path/to/python3.12"
    )


def _pip(pip: list[str], args: list[str], env: dict[str, str] | None = None) -> None:
    cmd = [*pip, "install", "--no-input", "--quiet", "--disable-pip-version-check", *args]
    _run(cmd, "pip install " + " ".join(a for a in args if not a.startswith("-")), env)


def _check(python: Path, packages: list[str], s: Spec, env: dict[str, str] | None = None) -> None:
    """Each pin installed at its version, and what matters imports."""
    names = [p.split("==")[0].split("[")[0] for p in packages if "==" in p]
    code = (
        "import importlib, importlib.metadata as m, sys\n"
        f"for name in {s.imports!r}: importlib.import_module(name)\n"
        f"for pin in {[p for p in packages if '==' in p]!r}:\n"
        "    name, version = pin.split('==')\n"
        "    got = m.version(name.split('[')[0])\n"
        "    assert got == version, f'{name} {got}, not {version}'\n"
    )
    _run([str(python), "-c", code], f"the side environment's imports ({', '.join(names)})", env)


def _purelib(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SideEnvError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _read(stamp: Path) -> object:
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dtf.sideenv",
        description="Make a side environment (once; anew when its pins change) and print its python.",
    )
    parser.add_argument(
        "name", choices=sorted(SPECS), help="; ".join(f"{n}: {s.purpose}" for n, s in sorted(SPECS.items()))
    )
    parser.add_argument("--dir", type=Path, help="where (default: <this venv>/side/NAME, or $DTF_SIDE_VENVS/NAME)")
    parser.add_argument("--python", help="a standalone one's interpreter (default: the first that fits)")
    args = parser.parse_args(argv)
    try:
        print(ensure(args.name, args.dir, args.python))
    except SideEnvError as e:
        lines = str(e).splitlines()
        print(f"dtf: error: {lines[0]}", *lines[1:], sep="\n", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
