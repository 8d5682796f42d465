"""Where a checkpoint's items are written (dtf.train.save_plan): the small items every rank holds
alike, all in rank 0's file and ahead of everything else there, so that a resuming rank fetches
them in one byte range; the large replicated ones (DDP's weights) still spread over the ranks.
Read from DCP's own metadata of checkpoints that 2 ranks saved, synchronously (FSDP) and through
the asynchronous writer (DDP). That a resume from them ends where a straight run ends is
tests/e2e/test_checkpoint.py's and test_s3_checkpoint.py's."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from dtf.train.save_plan import SMALL_ITEM_BYTES
from tests.helpers.inprocess import train_on_ranks

# deep_mlp: 8 blocks of 256 x 256 weights (256 KB each) and small biases.
ARGS = ["model=deep_mlp", "data.dataset.num_points=640", "data.dataset.num_test=64", "trainer.max_steps=4"]
RUNS = {
    "fsdp": ["strategy=fsdp", "checkpoint.async_save=false"],
    "ddp": ["strategy=ddp", "checkpoint.async_save=true"],
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saved")
    runs = [(name, [*ARGS, *args, "checkpoint.every_n_steps=4"]) for name, args in RUNS.items()]
    train_on_ranks(2, runs, root)
    return {name: root / name / "checkpoints" / "step_000000004" for name in RUNS}


def _items(checkpoint: Path) -> list[tuple[str, int, int, str]]:
    """(file, offset, length, key) of every item, from the checkpoint's .metadata."""
    metadata: Any = pickle.loads((checkpoint / ".metadata").read_bytes())
    return sorted((i.relative_path, i.offset, i.length, index.fqn) for index, i in metadata.storage_data.items())


def _replicated(key: str) -> bool:
    """The items every rank of these runs holds alike: the optimizer's settings and step counts
    (FSDP and DDP), and DDP's whole parameters and moments."""
    return key.startswith("optim.param_groups.") or key.endswith(".step")


@pytest.mark.parametrize("strategy", sorted(RUNS))
def test_the_small_replicated_items_are_one_range_at_the_start_of_rank_0s_file(
    saved: dict[str, Path], strategy: str
) -> None:
    items = _items(saved[strategy])
    shared = [item for item in items if _replicated(item[3])]
    assert len(shared) > 20  # the settings, and a step count for each of the 20 parameters
    assert {file for file, *_ in shared} == {"__0_0.distcp"}
    in_rank_0 = [item for item in items if item[0] == "__0_0.distcp"]
    small_end = max(offset + length for _, offset, length, _ in in_rank_0 if length <= SMALL_ITEM_BYTES)
    assert all(offset >= small_end for _, offset, length, _ in in_rank_0 if length > SMALL_ITEM_BYTES)


def test_large_replicated_items_are_still_spread_over_the_ranks(saved: dict[str, Path]) -> None:
    large = [item for item in _items(saved["ddp"]) if item[2] > SMALL_ITEM_BYTES]
    per_file = {
        file: sum(length for f, _, length, _ in large if f == file) for file in ("__0_0.distcp", "__1_0.distcp")
    }
    assert min(per_file.values()) > 0.3 * sum(per_file.values()), per_file
