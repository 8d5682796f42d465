"""recipes/notebooks, executed in a real Jupyter kernel: dtf.run_function from notebook cells, with
the model and the training function defined in the notebook itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.helpers.notebooks import execute


def check_maggy_notebook(printed: list[str], world_size: int) -> dict:
    """The last cell printed the test loss and where the summary is; rank 0's lines reached the cell."""
    found = re.search(r"test loss ([0-9.]+) over (\d+) ranks; summary in (\S+)", printed[-1])
    assert found, printed[-1][-3000:]
    summary = json.loads((Path(found.group(3)) / "summary.json").read_text())
    assert summary["world_size"] == int(found.group(2)) == world_size
    assert f"{summary['result']['loss']:.4f}" == found.group(1)
    assert summary["result"]["loss"] < 0.2  # z = sin(y) + cos(x) has variance ~1: it learned
    assert "dtf: your function returned" in printed[-1] and "epoch 2: last batch loss" in printed[-1]
    return summary


def test_the_maggy_notebook_with_local_ranks(tmp_path: Path) -> None:
    printed = execute("maggy_approximator.ipynb", tmp_path, {"DTF_LAUNCHER": "local", "DTF_EPOCHS": "3"})
    summary = check_maggy_notebook(printed, 2)
    assert summary["launcher"] == "local"
