"""dtf's pytest plugin (dtf.testing), in dtf's own session, where the package's entry point loads
it as it does in a user's: dtf_compose and dtf_experiments here; dtf_run in tests/e2e (it starts
ranks), and a user's project with its own tree in tests/e2e/test_testing_plugin.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dtf
from dtf.testing import experiments, with_budget
from tests.helpers.inprocess import compose

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(dtf.__file__).resolve().parent


def test_the_plugin_is_loaded_by_the_packages_entry_point(pytestconfig: pytest.Config) -> None:
    import dtf.testing

    assert pytestconfig.pluginmanager.get_plugin("dtf") is dtf.testing


def test_loading_the_plugin_imports_neither_torch_nor_hydra() -> None:
    # every pytest session in an environment with dtf installed loads it
    code = "import sys, dtf.testing; print(sorted(m for m in ('torch', 'hydra', 'omegaconf') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_dtf_compose_is_hydras_composed_config_validated(dtf_compose) -> None:  # type: ignore[no-untyped-def]
    cfg = dtf_compose("strategy=zero", "launcher.nproc=4")
    assert cfg == compose("strategy=zero", "launcher.nproc=4")
    assert "hydra" not in cfg  # the job's config, as `python -m dtf --cfg job` prints it


@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        # a misspelled key
        (
            ["trainer.max_epoch=3"],
            "trainer.max_epoch is not a setting of dtf's trainer (did you mean trainer.max_epochs?)",
        ),
        (["strategy=zeroo"], "In 'config': Could not find 'strategy/zeroo'"),  # a misspelled option
        (["optimizer.lr=-1"], "optimizer.lr=-1 is invalid: give a positive learning rate"),  # dtf's checks
    ],
)
def test_dtf_compose_raises_dtfs_one_line_with_no_frame_of_dtf(dtf_compose, overrides: list[str], start: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(dtf.UserError) as err:
        dtf_compose(*overrides)
    assert str(err.value).startswith(start) and "\n" not in str(err.value)
    assert "search path" not in str(err.value)  # Hydra lists it after its message: not the user's business
    # what pytest would show of a test that failed of it: the test's own line, nothing inside dtf
    shown = [entry for entry in err.traceback.filter(err) if not Path(entry.path).is_relative_to(Path(__file__))]
    assert shown == [], [str(entry.path) for entry in shown]
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_dtf_compose_with_a_config_dir_of_ones_own(dtf_compose, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "wider.yaml").write_text("_target_: wide.Wide\nhidden: 8\n")  # tests/helpers/wide.py
    cfg = dtf_compose("model=wider", config_dir=tmp_path)
    assert cfg.model._target_ == "wide.Wide" and cfg.model.hidden == 8
    with pytest.raises(dtf.UserError, match=r"^config_dir=.* is not a directory"):
        dtf_compose(config_dir=tmp_path / "nope")


def test_experiments_of_dtfs_tree_are_its_experiments_and_recipes() -> None:
    names = [f"+experiment={p.stem}" for p in sorted((REPO / "conf" / "experiment").glob("*.yaml"))]
    names += [f"+recipe={p.stem}" for p in sorted((REPO / "recipes").glob("*.yaml"))]
    assert len(names) >= 6 and experiments() == names


def test_experiments_under_a_config_dir_of_ones_own(dtf_experiments, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for name in ("experiment/b.yaml", "experiment/a.yaml", "experiment/big/c.yaml", "recipe/r.yaml", "model/m.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    expected = ["+experiment=a", "+experiment=b", "+experiment=big/c", "+recipe=r"]
    assert experiments(tmp_path) == expected
    assert dtf_experiments(str(tmp_path)) == expected  # the fixture is the same function
    with pytest.raises(dtf.UserError, match=r"^config_dir=.*nope is not a directory"):
        experiments(tmp_path / "nope")


@pytest.mark.parametrize(
    ("overrides", "kept"),
    [
        ([], {"trainer.max_steps=2", "launcher=local", "launcher.nproc=2"}),
        (["trainer.max_steps=5"], {"launcher=local", "launcher.nproc=2"}),  # the given value, not the budget's
        (["+trainer.max_steps=5"], {"launcher=local", "launcher.nproc=2"}),
        (["launcher.nproc=1"], {"trainer.max_steps=2", "launcher=local"}),
        (["launcher=slurm"], {"trainer.max_steps=2"}),  # another launcher: none of the local one's keys
        (["trainer=function"], {"trainer.max_steps=2", "launcher=local", "launcher.nproc=2"}),
    ],
)
def test_the_tiny_budget_gives_way_to_the_tests_own_overrides(overrides: list[str], kept: set[str]) -> None:
    merged = with_budget(overrides)
    assert merged[-len(overrides) :] == overrides if overrides else True  # the test's own come last
    budget = merged[: len(merged) - len(overrides)]
    relevant = {"trainer.max_steps=2", "launcher=local", "launcher.nproc=2"}
    assert relevant & set(budget) == kept
    assert "trainer.dist_timeout_s=60" in budget  # a hang fails in a minute


def test_the_plugins_module_is_where_the_entry_point_says() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest's own TOML parser
        import tomli as tomllib  # type: ignore[no-redef]

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["pytest11"] == {"dtf": "dtf.testing"}
    assert (PACKAGE / "testing.py").is_file()


# A session of its own (the plugin loaded by its entry point, as in a user's), with dtf.run replaced
# by one that only makes the run directory: what dtf_run leaves behind, not what a run does.
CLEANUP_TESTS = """
import multiprocessing, os, time
from pathlib import Path

import pytest

import dtf.api
from dtf.testing import TINY_BUDGET

OUT = Path(os.environ["CLEANUP_OUT"])


@pytest.fixture(autouse=True)
def fake_run(monkeypatch):
    def run(overrides, config_dir=None, run_dir=None):
        Path(run_dir).mkdir()
        return {"run_dir": run_dir, "overrides": overrides}

    monkeypatch.setattr(dtf.api, "run", run)


def test_passes(dtf_run):
    summary = dtf_run("launcher.nproc=1")
    assert summary["overrides"] == [o for o in TINY_BUDGET if o != "launcher.nproc=2"] + ["launcher.nproc=1"]
    (OUT / "passed_run_dir").write_text(summary["run_dir"])
    rank = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))  # a rank left running
    rank.start()
    (OUT / "rank_pid").write_text(str(rank.pid))
    os.environ["SET_BY_A_RUN"] = "1"


def test_fails(dtf_run):
    (OUT / "failed_run_dir").write_text(dtf_run()["run_dir"])
    assert False


def test_after(dtf_run):
    assert "SET_BY_A_RUN" not in os.environ
"""


def test_dtf_run_leaves_no_rank_nor_environment_nor_a_passed_tests_run_dir(tmp_path: Path) -> None:
    import os

    (tmp_path / "test_cleanup.py").write_text(CLEANUP_TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")} | {"CLEANUP_OUT": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'basetemp'}", "-q"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert "1 failed, 2 passed" in done.stdout, done.stdout[-3000:]
    assert not Path((tmp_path / "passed_run_dir").read_text()).exists()
    assert Path((tmp_path / "failed_run_dir").read_text()).is_dir()  # kept for its logs
    pid = int((tmp_path / "rank_pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
