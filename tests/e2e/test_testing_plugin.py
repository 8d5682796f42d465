"""A user's project tests its own configs with dtf's pytest plugin and nothing else: the
example of docs/testing.md, written out as its files, passes with plain `pytest`
and with `pytest -n 2`; a misspelled override fails with dtf's one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import dtf

REPO = Path(__file__).resolve().parents[2]
PYTEST = Path(sys.executable).parent / "pytest"  # the console script a user types, not python -m pytest


def readme_project(root: Path) -> list[str]:
    """Writes the page's files (each code block after a line "`<path>`...:") under root."""
    section = (REPO / "docs" / "testing.md").read_text()
    written = []
    blocks = r"^`([\w/]+\.(?:py|yaml))`[^\n]*:\n\n```(?:yaml|python)\n(.*?)```"
    for path, block in re.findall(blocks, section, re.S | re.M):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(block)
        written.append(path)
    return written


def pytest_in(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "PYTHONPATH") and not k.startswith("PYTEST_")}
    return subprocess.run(
        [str(PYTEST), "-p", "no:cacheprovider", f"--basetemp={project.parent / 'basetemp'}", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_users_project_tests_its_configs_with_the_plugins_fixtures(tmp_path: Path) -> None:
    project = tmp_path / "project"
    files = readme_project(project)
    assert sorted(files) == ["conf/experiment/my_exp.yaml", "conf/model/my_mlp.yaml", "my_models.py", "test_configs.py"]
    assert not list(project.rglob("conftest.py"))

    plain = pytest_in(project)
    assert plain.returncode == 0, plain.stdout[-5000:] + plain.stderr[-3000:]
    assert re.search(r"\b4 passed\b", plain.stdout), plain.stdout[-3000:]
    assert not list((tmp_path / "basetemp").rglob("dtf_run*")), "a passed test's run directory was left"

    # pytest-xdist is in dtf's dev extras: the fixtures must work side by side in its workers
    side_by_side = pytest_in(project, "-n", "2")
    assert side_by_side.returncode == 0, side_by_side.stdout[-5000:] + side_by_side.stderr[-3000:]
    assert re.search(r"\b4 passed\b", side_by_side.stdout) and "2 workers" in side_by_side.stdout


def test_a_misspelled_override_fails_the_users_test_with_dtfs_one_line(tmp_path: Path) -> None:
    project = tmp_path / "project"
    readme_project(project)
    (project / "test_configs.py").unlink()
    (project / "test_typo.py").write_text(
        "def test_my_experiment_runs(dtf_run):\n"
        '    dtf_run("+experiment=my_exp", "trainer.max_step=2", config_dir="conf")  # max_steps\n'
    )
    done = pytest_in(project)
    assert done.returncode == 1, done.stdout[-3000:]
    errors = [line for line in done.stdout.splitlines() if line.startswith("E ")]
    assert len(errors) == 1, done.stdout
    want = r"E +dtf\.errors\.UserError: trainer\.max_step is not a setting of dtf's trainer "
    want += r"\(did you mean trainer\.max_steps\?\)$"
    assert re.match(want, errors[0]), errors  # the nearest key, on one line
    assert str(Path(dtf.__file__).parent) not in done.stdout  # no frame from inside dtf
    assert not list((tmp_path / "basetemp").rglob("dtf_run0"))  # refused before anything was written
