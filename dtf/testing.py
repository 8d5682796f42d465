"""dtf's pytest plugin: test your own configs, models and experiments (README, "Testing your
configs"). dtf's `pytest11` entry point loads it into every pytest session of an environment
with dtf installed, so a test takes its fixtures by name, with no conftest code:

    dtf_compose(*overrides, config_dir=None) -> DictConfig   the config `python -m dtf` would run, checked
    dtf_run(*overrides, config_dir=None) -> dict             its summary.json after a tiny run (TINY_BUDGET)
    dtf_experiments(config_dir=None) -> list[str]            "+experiment=<name>", "+recipe=<name>" overrides

config_dir: a directory of your own configs on dtf's search path, as dtf.run's (your options of
dtf's groups, your experiments). A fixture cannot feed pytest.mark.parametrize, which runs at
collection: `from dtf.testing import experiments` is dtf_experiments as a plain function.

A bad override or setting fails the test with dtf's one line (a dtf.UserError, raised from the
fixture with no frame of dtf's below it). Loaded everywhere, this module imports nothing heavy:
Hydra, torch and dtf's run machinery are imported when a fixture is first called.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dtf.errors import UserError

if TYPE_CHECKING:
    from omegaconf import DictConfig

# What dtf_run puts before a test's own overrides: two optimizer steps (then the final evaluation)
# on two local ranks, no progress output, and collectives that time out in a minute, so that a
# hang fails the test instead of stalling it. A test's own override of a key (or its choice of
# another launcher) replaces the budget's.
TINY_BUDGET = (
    "trainer.max_steps=2",
    "trainer.progress=off",
    "trainer.dist_timeout_s=60",
    "launcher=local",
    "launcher.nproc=2",
)
_BUDGET_GROUPS = {"launcher"}  # choosing another option of these drops the budget's keys under them

PathLike = str | os.PathLike[str]


def experiments(config_dir: PathLike | None = None) -> list[str]:
    """The overrides that select each experiment and recipe: `+experiment=<name>` for every
    experiment/<name>.yaml under config_dir (subfolders too: `+experiment=<sub>/<name>`), then
    `+recipe=<name>` for every recipe/<name>.yaml; without config_dir, dtf's own experiments and
    recipes. For `pytest.mark.parametrize("experiment", experiments(CONF))`."""
    if config_dir is None:
        from importlib.resources import files

        from dtf.config.store import recipe_names

        tree = files("dtf.conf") / "experiment"
        names = sorted(p.name.removesuffix(".yaml") for p in tree.iterdir() if p.name.endswith(".yaml"))
        return [f"+experiment={n}" for n in names] + [f"+recipe={n}" for n in recipe_names()]
    root = _directory(config_dir)
    found = []
    for group in ("experiment", "recipe"):
        files_ = sorted((root / group).rglob("*.yaml"), key=lambda p: p.relative_to(root / group).as_posix())
        found += [f"+{group}={p.relative_to(root / group).with_suffix('').as_posix()}" for p in files_]
    return found


def with_budget(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """TINY_BUDGET, less what the given overrides set themselves, then those overrides."""
    given = {_key(o) for o in overrides}
    dropped = {g for g in given if g in _BUDGET_GROUPS}

    def replaced(entry: str) -> bool:
        key = _key(entry)
        return key in given or any(key.startswith(f"{group}.") for group in dropped)

    return [entry for entry in TINY_BUDGET if not replaced(entry)] + list(overrides)


def compose(*overrides: str, config_dir: PathLike | None = None) -> DictConfig:
    """The job config `python -m dtf <overrides>` (with `--config-dir config_dir`) would run, as it
    prints with `--cfg job`, after the run's checks (dtf.validate). Raises dtf.UserError."""
    from dtf.api import _compose, validate

    cfg, _, _ = _compose(list(overrides), _config_dir(config_dir), "run")
    validate(cfg)
    return cfg


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _directory(config_dir: PathLike) -> Path:
    if not Path(config_dir).is_dir():
        raise UserError(f"config_dir={config_dir} is not a directory: give the directory of your config groups")
    return Path(config_dir).resolve()


def _config_dir(config_dir: PathLike | None) -> str | None:
    return None if config_dir is None else str(_directory(config_dir))


@pytest.fixture
def dtf_compose() -> Callable[..., DictConfig]:
    """dtf_compose(*overrides, config_dir=None) -> the composed config, checked as a run checks it."""

    def _compose_for_test(*overrides: str, config_dir: PathLike | None = None) -> DictConfig:
        __tracebackhide__ = True
        try:
            return compose(*overrides, config_dir=config_dir)
        except UserError as e:
            raise e.with_traceback(None) from None  # the test's line and dtf's message, no frame of dtf's

    return _compose_for_test


@pytest.fixture
def dtf_run(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., dict[str, Any]]]:
    """dtf_run(*overrides, config_dir=None) -> summary.json of a run for TINY_BUDGET (with the test's
    own overrides after it), made by dtf.run in this process, in tmp_path/dtf_run<n>.

    Afterwards: ranks still alive are killed (a test that failed while they ran), the environment
    variables a run sets are put back, and a passed test's run directories are removed (a failed
    test's stay, for their logs). Each run's rendezvous uses a port the system picks (launcher=local),
    so runs side by side (pytest -n auto) do not clash."""
    made: list[Path] = []
    children = set(multiprocessing.active_children())
    environ = dict(os.environ)

    def _run(*overrides: str, config_dir: PathLike | None = None) -> dict[str, Any]:
        __tracebackhide__ = True
        from dtf.api import run

        run_dir = tmp_path / f"dtf_run{len(made)}"
        made.append(run_dir)
        try:
            return run(with_budget(overrides), config_dir=_config_dir(config_dir), run_dir=str(run_dir))
        except UserError as e:  # a bad setting, or a rank that failed (its line names its log)
            raise e.with_traceback(None) from None

    yield _run
    for child in multiprocessing.active_children():
        if child not in children:
            child.kill()
            child.join(10)
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
    reports = request.node.stash.get(_REPORTS, {})
    if made and reports and not any(report.failed for report in reports.values()):
        for run_dir in made:
            shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def dtf_experiments() -> Callable[..., list[str]]:
    """dtf_experiments(config_dir=None) -> the experiments' and recipes' overrides (dtf.testing.experiments)."""
    return experiments


_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Keeps each phase's report on the test, for dtf_run's teardown to see whether it passed."""
    outcome = yield
    report = outcome.get_result()
    item.stash.setdefault(_REPORTS, {})[report.when] = report
