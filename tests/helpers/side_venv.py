"""The side environments the tests need (dtf.sideenv makes them, once), with the tests' policy
for one that cannot be made: as for the clusters, a green `make test` proves what runs in them,
so the test fails; only a user who says so (DTF_SKIP_SIDE_VENV_TESTS=1, a machine without a
package index) skips it, saying why."""

from __future__ import annotations

from pathlib import Path

from dtf import sideenv
from tests.helpers.clusters import skip_if_asked


def side_python(name: str) -> Path:
    """The python of dtf's side environment `name` (hydra-optuna, petastorm), made on first use."""
    try:
        return sideenv.ensure(name)
    except sideenv.SideEnvError as e:
        skip_if_asked(
            f"the side environment {name} could not be made ({e})",
            "DTF_SKIP_SIDE_VENV_TESTS",
            "these tests on a machine without a package index",
        )
