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


def check_horovod_notebook(printed: list[str], world_size: int, cwd: Path) -> dict:
    """train_hvd ran on the ranks (rank 0's lines reached the cell), its checkpoint trained the model."""
    assert "Train Epoch: 2 " in printed[-2], printed[-2][-3000:]  # the HorovodRunner cell, rank 0 only
    assert printed[-2].count("Train Epoch: 1 [0/") == 1
    found = re.search(r"test accuracy ([0-9.]+)% .* on (\d+) ranks", printed[-1])
    assert found and int(found.group(2)) == world_size, printed[-1][-2000:]
    assert float(found.group(1)) > 50  # 2 epochs; chance is 10%
    (summary_file,) = cwd.glob("outputs/*/*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["mode"] == "torchrun" and summary["world_size"] == world_size
    return summary


def test_the_horovodrunner_notebook_with_local_ranks(tmp_path: Path) -> None:
    # Databricks' notebook with `from sparkdl import HorovodRunner` changed, HorovodRunner(np=-2)
    printed = execute("horovod_mnist.ipynb", tmp_path, {"DTF_HVD_NP": "-2", "DTF_EPOCHS": "2"})
    assert check_horovod_notebook(printed, 2, tmp_path)["launcher"] == "local"
