"""dtf as a package: a regular (not editable) install carries the config tree (conf/ at the
repository's top, installed as dtf.conf), and `python -m dtf` runs from any directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtf import sideenv
from tests.helpers.run_command import dtf_command, run_command

REPO = Path(__file__).resolve().parents[2]
# What a source distribution of dtf holds: the build needs nothing else.
SOURCES = ["pyproject.toml", "setup.py", "README.md", "conf", "recipes", "dtf", "hydra_plugins"]


@pytest.fixture(scope="module")
def installed_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with dtf installed from a copy of its sources by `pip install .` (no -e).
    Its dependencies come from the test venv's site-packages, added as a plain path: that venv's
    own .pth files (its editable dtf) are not read, so `import dtf` can only find this install."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, src / name)
    venv = tmp / "venv"
    subprocess.run([sideenv.base_python(), "-m", "venv", "--without-pip", str(venv)], check=True)
    python = sideenv.python_of(venv)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # The test venv's pip puts a regular (non-editable) install into the fresh venv's
    # site-packages, building the wheel with the test venv's setuptools (no download). --target,
    # not --prefix: pip then ignores what is installed where it runs, instead of uninstalling the
    # test venv's own (editable) dtf to replace it.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            site,
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    deps = sideenv.main_site_packages()  # plain paths: their .pth files (the editable dtf) are not read
    (Path(site) / "_test_venv_packages.pth").write_text("".join(f"{p}\n" for p in deps))
    return python


def _run(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_command(dtf_command(*args, python=python), cwd=cwd, timeout=300)


def test_the_installed_package_carries_the_config_tree(installed_python: Path, tmp_path: Path) -> None:
    where = subprocess.run(
        [str(installed_python), "-c", "import dtf, dtf.conf; print(dtf.__file__); print(dtf.conf.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(str(REPO) not in path for path in where), where  # not the checkout's files
    conf = Path(where[1]).parent
    assert conf == Path(where[0]).parent / "conf"
    assert sorted(p.relative_to(conf).as_posix() for p in conf.rglob("*.yaml")) == sorted(
        p.relative_to(REPO / "conf").as_posix() for p in (REPO / "conf").rglob("*.yaml")
    )
    # and the recipes, as the package dtf.recipes (+recipe=<name>)
    recipes = Path(where[0]).parent / "recipes"
    assert sorted(p.name for p in recipes.glob("*.yaml")) == sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))


def test_the_installed_package_composes_and_trains_from_another_directory(
    installed_python: Path, tmp_path: Path
) -> None:
    shown = _run(installed_python, tmp_path, "--cfg", "job")
    assert "_target_: dtf.models.approximator.Approximator" in shown.stdout
    recipe = _run(installed_python, tmp_path, "+recipe=horovod_mnist", "--cfg", "job")
    assert "_target_: dtf.models.mnist_cnn.MnistCNN" in recipe.stdout
    run_dir = tmp_path / "run"
    _run(
        installed_python,
        tmp_path,
        "trainer.max_epochs=1",
        "data.dataset.num_points=2000",
        "data.dataset.num_test=400",
        "trainer.progress=off",
        f"hydra.run.dir={run_dir}",
    )
    assert (run_dir / "summary.json").is_file()


def test_the_installed_package_carries_its_pytest_plugin(installed_python: Path, tmp_path: Path) -> None:
    code = (
        "import importlib.metadata as m, dtf.testing\n"
        "plugins = [(e.name, e.value) for e in m.distribution('dtf').entry_points if e.group == 'pytest11']\n"
        "print(plugins, dtf.testing.__file__)"
    )
    shown = subprocess.run(
        [str(installed_python), "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    plugins, path = shown.rsplit(" ", 1)
    assert plugins == "[('dtf', 'dtf.testing')]" and str(REPO) not in path, shown
