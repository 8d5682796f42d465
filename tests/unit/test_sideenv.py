"""dtf.sideenv: the side environments' pins come from dtf's extras, a made one is found by its
stamp, and what cannot be made or is missing is said in one line. (Making them, and running in
them, is in tests/e2e/test_prepare_petastorm.py and tests/e2e/test_hydra_optuna.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dtf import sideenv
from dtf.data import prepare

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(sideenv.SPECS))
def test_the_pins_are_the_extra_of_the_same_name(name: str) -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][name]
    assert sideenv.pins(name) == [line.replace(" ", "") for line in declared]
    assert all("==" in pin for pin in sideenv.pins(name))  # exact: the environment is made from these alone


def _fake_made(venv: Path, stamp: dict[str, object]) -> None:
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / sideenv.STAMP_FILE).write_text(json.dumps(stamp))


def test_a_made_environment_is_found_until_its_pins_change(tmp_path: Path) -> None:
    venv = tmp_path / "petastorm"
    assert sideenv.find("petastorm", venv) is None  # not made
    _fake_made(venv, {"packages": sideenv.pins("petastorm"), "base": "/some/python3.11"})
    assert sideenv.find("petastorm", venv) == venv / "bin" / "python"
    (venv / sideenv.STAMP_FILE).write_text(json.dumps({"packages": ["petastorm==0.12.1"]}))
    assert sideenv.find("petastorm", venv) is None  # other pins: made anew by ensure
    (venv / sideenv.STAMP_FILE).unlink()
    assert sideenv.find("petastorm", venv) is None  # half made (interrupted): the stamp is written last


def test_a_layered_environment_is_found_only_over_the_same_main_venv(tmp_path: Path) -> None:
    venv = tmp_path / "hydra-optuna"
    current = {"packages": sideenv.pins("hydra-optuna"), "base": sideenv.base_python()}
    _fake_made(venv, {**current, "main_site_packages": sideenv.main_site_packages()})
    assert sideenv.find("hydra-optuna", venv) == venv / "bin" / "python"
    (venv / sideenv.STAMP_FILE).write_text(json.dumps({**current, "main_site_packages": ["/elsewhere"]}))
    assert sideenv.find("hydra-optuna", venv) is None


def test_no_python_in_the_pins_range_is_one_line_naming_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DTF_SIDE_PYTHON", raising=False)
    spec = sideenv.Spec("petastorm", layered=False, imports=(), pythons=("3.98", "3.99"))
    monkeypatch.setitem(sideenv.SPECS, "petastorm", spec)
    with pytest.raises(sideenv.SideEnvError) as e:
        sideenv._interpreter(spec, None)
    assert "needs Python 3.99 to 3.98" in str(e.value) and "DTF_SIDE_PYTHON=" in str(e.value)
    with pytest.raises(sideenv.SideEnvError, match=f"needs Python 3.99 to 3.98, and {sys.executable} is not one"):
        sideenv._interpreter(spec, sys.executable)
    # and the command line says it in one line, exit status 1 (nothing the user typed was wrong)
    monkeypatch.setenv("DTF_SIDE_VENVS", str(tmp_path))
    assert sideenv.main(["petastorm"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("dtf: error: the petastorm environment needs Python 3.99 to 3.98")


@pytest.mark.parametrize("fmt", ["petastorm", "both"])
def test_prepare_without_the_petastorm_environment_is_one_line_saying_how_to_make_it(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DTF_SIDE_VENVS", str(tmp_path / "side"))  # none made there
    out = tmp_path / "data"
    assert prepare.main(["digits", "--out", str(out), "--format", fmt]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dtf: error: --format petastorm writes with Petastorm")
    assert err[0].endswith("make it once with `python -m dtf.sideenv petastorm`, then run this again")
    assert not out.exists()  # nothing written, not even the Parquet copy of --format both
