"""dtf.elastic in process: the world sizes an elastic run may take at one global batch, each
rank's batch on them, the LR that stays the same, and a membership change's record (the runs
themselves: tests/e2e/test_multinode.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from dtf import elastic
from dtf.config.typed import RunConfig, typed
from dtf.data.parquet.plan import partitions_problem
from dtf.errors import UserError
from dtf.preflight import validate


def run_of(*overrides: str) -> RunConfig:
    with initialize_config_module("dtf.conf", version_base="1.3"):
        return typed(compose("config", overrides=list(overrides)))


ACROSS = ["launcher.rdzv_endpoint=node1:29500"]


def test_the_sizes_that_cannot_keep_the_global_batch_are_never_admitted() -> None:
    # 1 to 4 nodes of one rank at G = 64: 3 cannot (64 / 3), so the rendezvous admits 1 to 2.
    p = elastic.plan(run_of(*ACROSS, "launcher.nproc=1", "launcher.nnodes=1:4", "data.global_batch_size=64"))
    assert p is not None and p.legal_nodes == (1, 2, 4) and (p.min_nodes, p.max_nodes) == (1, 2)
    assert [p.per_rank_batch(w) for w in p.world_sizes()] == [64, 32]
    assert p.describe() == "elastic: 1 to 2 nodes (not 3, 4: cannot keep it), world sizes 1, 2, global batch 64 on each"
    # Without data.global_batch_size: the full-size run's (data.batch_size 32 x 2 ranks x 2 nodes).
    p = elastic.plan(run_of(*ACROSS, "launcher.nnodes=1:2"))
    assert p is not None and p.global_batch == 128 and p.world_sizes() == [2, 4]
    assert elastic.plan(run_of()) is None  # one node, a per-rank batch: nothing to plan


def test_the_lr_is_scaled_as_for_the_configured_batch_on_every_size() -> None:
    run = run_of(*ACROSS, "launcher.nproc=1", "launcher.nnodes=1:2", "data.global_batch_size=64")
    factors = set()
    for world in (1, 2):
        elastic.apply(run, world)
        assert run.data.batch_size * world == 64
        factors.add(elastic.scaling_world_size(run, world))
    assert factors == {2.0}  # 64 / data.batch_size 32, as a 2-rank run without a global batch scales


def test_parquet_partitions_fit_every_admitted_size() -> None:
    run = run_of(
        *ACROSS, "data=parquet", "data.path=x", "launcher.nproc=2", "launcher.nnodes=1:4", "data.global_batch_size=96"
    )
    p = elastic.plan(run)
    assert p is not None and p.partitions is not None
    assert p.world_sizes() == [2, 4, 6, 8]
    for world in p.world_sizes():
        assert partitions_problem(p.partitions, world, 96) is None
    assert p.partitions == math.gcd(96, math.lcm(24, 2, 4, 6, 8))
    elastic.apply(run, 6)
    assert run.data.batch_size == 16 and run.data.canonical_partitions == p.partitions


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["launcher.nnodes=3:2"], "launcher.nnodes=3:2 is invalid: give a number of nodes (2) or an elastic range"),
        (["launcher.nnodes=0:2"], "launcher.nnodes=0:2 is invalid: give a number of nodes (2) or an elastic range"),
        (
            ["launcher.nnodes=1:2", "launcher.nproc=3", "data.global_batch_size=64"],
            "launcher.nnodes=1:2: no world size of this run (3, 6 ranks, x trainer.grad_accum_steps=1) divides the "
            "global batch 64 (data.global_batch_size): give data.global_batch_size a multiple of 6, e.g. 60",
        ),
        (["launcher.nproc=3", "data.global_batch_size=64"], "data.global_batch_size=64: no world size of this run"),
        (["data.global_batch_size=0"], "data.global_batch_size=0 is invalid"),
        (["launcher.nnodes=1:2", "+launcher.rdzv_configs.join_timout=5"], "launcher.rdzv_configs.join_timout is not"),
        (["+launcher.rdzv_configs.join_timeout=5"], "launcher.rdzv_configs.join_timeout: the rendezvous settings have"),
        (["launcher=slurm", "launcher.nodes=1:2"], "launcher.nodes=1:2: a SLURM job keeps the nodes it starts on"),
    ],
)
def test_bad_elastic_settings_are_refused_in_one_line(overrides: list[str], line: str) -> None:
    with initialize_config_module("dtf.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides if "launcher=slurm" in overrides else [*ACROSS, *overrides])
    with pytest.raises(UserError) as err:
        validate(cfg)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_a_change_records_the_steps_the_old_world_did_after_the_checkpoint(tmp_path: Path) -> None:
    elastic.record_end(tmp_path, 0, 2, 57)
    elastic.record_end(tmp_path, 1, 2, 57)
    ended = elastic.take_ended(tmp_path)
    assert not list((tmp_path / elastic.ENDED_DIR).iterdir())  # taken: a later change does not see them
    change = elastic.change(ended, 50, 2, 1)
    done = elastic.complete(change, ended[0].time + 12.5)
    assert done == {
        "step": 50,
        "old_world_size": 2,
        "new_world_size": 1,
        "time_lost_s": 12.5,
        "steps_recomputed": 7,
    }
