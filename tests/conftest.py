"""Fixtures that run `python -m dtf` as a user would (tests/helpers/run_command.py), in a temporary run directory."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.run_command import HELPERS, DtfRun, run_dtf
from tests.helpers.run_command import dtf_env as dtf_env  # for the files that import it from here

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def dtf(tmp_path: Path):  # type: ignore[no-untyped-def]
    """dtf(args...) -> DtfRun, in a fresh run directory under tmp_path."""
    counter = iter(range(1000))

    def _run(*args: str, **kw: Any) -> DtfRun:
        return run_dtf(list(args), tmp_path / f"run{next(counter)}", **kw)

    return _run


@pytest.fixture(scope="session")
def composed() -> Any:
    """composed(*overrides): compose_config's config of them, composed once per session (read-only)."""
    from tests.helpers.inprocess import compose_config

    return functools.cache(lambda *overrides: compose_config(list(overrides)))


# A short 2-rank DDP run: the launcher tests (SLURM, Spark) compare their result with it.
SHORT_RUN = ["trainer.max_steps=30", "data.dataset.num_points=2000", "data.dataset.num_test=200"]


@pytest.fixture(scope="session")
def short_local_run(tmp_path_factory: pytest.TempPathFactory) -> DtfRun:
    """SHORT_RUN with launcher=local, run once per session."""
    return run_dtf(SHORT_RUN, tmp_path_factory.mktemp("short_local") / "run")


# Files whose tests start and stop the one local SLURM cluster, Spark cluster or namespace hosts
# the machine can hold at a time: under pytest-xdist they run in one worker, one after the other.
CLUSTER_FILES = {
    "test_slurm.py",
    "test_spark.py",
    "test_multinode.py",
    "test_hydra_optuna.py",
    "test_horovod_launchers.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start real processes and clusters (tests/e2e, tests/dist) are slow by where they
    live: `make test-fast` (-m "not slow") runs the rest (tests/unit, tests/config: mostly in
    process, some with gloo ranks or short child processes); `make test` runs everything.

    They also run first, the cluster files first of all (one long chain in one worker): with two
    xdist workers the short tests come last and fill whichever worker is free, instead
    of one worker finishing a long file while the other waits."""

    def slow(item: pytest.Item) -> bool:
        return bool({"e2e", "dist"} & set(Path(str(item.fspath)).relative_to(REPO).parts))

    for item in items:
        if slow(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: 0 if Path(str(item.fspath)).name in CLUSTER_FILES else 1 if slow(item) else 2)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs two pytest-xdist workers with --dist loadfile --no-loadscope-reorder: a
    file's tests stay in one worker (its module fixtures, such as a straight run the others compare
    with, run once), here the cluster files count as one file, and files go out in the order of
    pytest_collection_modifyitems (xdist's reorder would send files with many short tests first).
    xdist_group markers with --dist loadgroup would say the same, but pytest-xdist 3.8 under
    pytest 9 did not group by them here (four files of one group ran on both workers)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndClusters(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "clusters" if Path(path).name in CLUSTER_FILES else path

    return FilesAndClusters(config, log)


# In-process tests import the helper modules the way a user's PYTHONPATH would expose them.
sys.path.insert(0, str(HELPERS))
