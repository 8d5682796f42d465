"""The side environments the tests need (dtf.sideenv makes them, once), with the tests' policy
for one that cannot be made: as for the clusters, a green `make test` proves what runs in them,
so the test fails; only a user who says so (DTF_SKIP_SIDE_VENV_TESTS=1, a machine without a
package index) skips it, saying why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dtf import sideenv


def side_python(name: str) -> Path:
    """The python of dtf's side environment `name` (hydra-optuna, petastorm), made on first use."""
    try:
        return sideenv.ensure(name)
    except sideenv.SideEnvError as e:
        if os.environ.get("DTF_SKIP_SIDE_VENV_TESTS") == "1":
            pytest.skip(
                f"the side environment {name} could not be made ({e}); "
                "skipped because DTF_SKIP_SIDE_VENV_TESTS=1 (unset it to run them)"
            )
        pytest.fail(
            f"the side environment {name} could not be made: {e} "
            "(set DTF_SKIP_SIDE_VENV_TESTS=1 to skip these tests on a machine without a package index)"
        )
