"""Elastic determinism through `python -m dtf`: at one global batch (SGD, no LR scaling), a
2-rank run on a Petastorm dataset written by Petastorm through Spark (its codecs decoded), resumed
mid-epoch on 4 ranks, ends where the straight 2-rank run ends; a world size the canonical
partitions cannot feed is refused in one line (plain Parquet written by pyarrow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import user_datasets
from tests.helpers.inprocess import train_in_process
from tests.helpers.run_command import DtfRun, run_dtf

G = 64  # the global batch: data.batch_size = G / world size
K = 40  # a checkpoint in the middle of epoch 2 (31 steps per epoch: 2000 rows)
COMMON = [
    "optimizer=sgd",
    "optimizer.lr=0.05",
    "trainer.lr_scaling=none",
    "trainer.max_epochs=2",
    "trainer.seed=0",
    f"checkpoint.every_n_steps={K}",
    # One intra-op thread per rank on every world size: what is compared is the data order. With
    # two threads (the default for one rank on this 2-core machine), a 1-rank run ended now and
    # then 8.7e-4 away from its usual parameters, run to run, on the same samples.
    "+launcher.env.OMP_NUM_THREADS=1",
]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def data_args(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    base = tmp_path_factory.getbasetemp() / "user_datasets"
    parquet = user_datasets.write_field_parquet(tmp_path_factory.mktemp("field") / "parquet")
    return {
        "parquet": ["data=petastorm", f"data.path={parquet}"],
        "petastorm": ["data=petastorm", f"data.path={user_datasets.field_petastorm(base)}"],
    }


def on(world: int) -> list[str]:
    return [f"launcher.nproc={world}", f"data.batch_size={G // world}"]


def max_difference(a: DtfRun, b: DtfRun) -> float:
    pa = torch.load(a.run_dir / "model.pt", weights_only=True)
    pb = torch.load(b.run_dir / "model.pt", weights_only=True)
    assert pa.keys() == pb.keys()
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)


# In-memory data on other world sizes: tests/dist/test_equivalence.py (2 ranks = one process's loop)
# and tests/e2e/test_checkpoint.py (a resume onto another world size and strategy). Plain Parquet on
# 1 and 2 ranks (2 -> 1 -> 2 -> 1 -> 2 mid-run): tests/e2e/test_multinode.py's elastic test, against
# a straight 2-rank run.
def test_a_petastorm_datasets_2_rank_run_resumed_on_4_ends_at_the_straight_runs_parameters(
    tmp_path: Path, data_args: dict[str, list[str]]
) -> None:
    # A Petastorm dataset is read by the same reader as Parquet (its codecs decoded on the way); the
    # resume trains on 4 ranks from the middle of epoch 2 on.
    args = [*COMMON, *data_args["petastorm"]]
    straight = run_dtf([*args, *on(2)], tmp_path / "ranks2")
    checkpoint = straight.run_dir / "checkpoints" / f"step_{K:09d}"
    resumed = run_dtf([*args, *on(4), f"checkpoint.resume={checkpoint}"], tmp_path / "resumed")
    steps = straight.summary["global_step"]
    assert K < steps < 2 * K  # K is in the middle of epoch 2
    assert straight.summary["world_size"] == 2
    assert "of a Petastorm dataset (codecs decoded)" in straight.stdout
    assert "8 canonical partitions" in straight.stdout  # auto: gcd(64, 24)
    s = resumed.summary
    assert s["resumed_from_step"] == K and s["world_size"] == 4 and s["global_step"] == steps
    assert "world size changed (2 -> 4)" in resumed.stdout
    assert "seen twice" not in resumed.stdout and "not at all" not in resumed.stdout  # the position is exact
    difference = max_difference(resumed, straight)
    assert difference <= TOLERANCE, difference
    assert straight.summary["final_train_loss"] < straight.summary["train_loss_per_epoch"][0]  # it trained


def test_a_world_size_that_does_not_divide_the_partitions_is_refused_in_one_line(
    tmp_path: Path, data_args: dict[str, list[str]]
) -> None:
    args = [*COMMON, *data_args["parquet"]]
    asked = run_dtf(
        [*args, "launcher.nproc=3", "data.batch_size=16", "data.canonical_partitions=8"], tmp_path / "asked", expect=2
    )
    # A run's checkpoint recorded C = 8 (auto at G = 64, on 1 rank); its resume on 3 ranks cannot use it.
    train_in_process([*args, "launcher.nproc=1", "data.batch_size=64", "trainer.max_steps=3"], tmp_path / "recorded")
    recorded = run_dtf([*args, "launcher.nproc=3", "data.batch_size=16"], tmp_path / "recorded", expect=2)
    fix = "a world size that divides 8 (1, 2, 4, 8) and a global batch that 8 divides"
    for run, line in (
        (
            asked,
            f"the world size 3 does not divide data.canonical_partitions=8: use {fix}, "
            "or data.canonical_partitions=auto",
        ),
        (
            recorded,
            "the world size 3 does not divide data.canonical_partitions=8 (the run's checkpoint recorded "
            f"data.canonical_partitions=8): resume on {fix}, or start afresh with checkpoint.resume=never",
        ),
    ):
        assert run.stderr.strip().splitlines() == [f"dtf: error: {line}"]
        assert "rank(s), strategy=" not in run.stdout  # refused before any rank started
