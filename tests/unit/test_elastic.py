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
from dtf.testing import compose as compose_dtf


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


def test_an_elastic_slurm_job_takes_the_sizes_of_its_nodes_times_their_tasks() -> None:
    p = elastic.plan(
        run_of("launcher=slurm", "launcher.nodes=1:4", "launcher.tasks_per_node=1", "data.global_batch_size=64")
    )
    assert p is not None and (p.min_nodes, p.max_nodes, p.nproc) == (1, 2, 1) and p.legal_nodes == (1, 2, 4)
    p = elastic.plan(run_of("launcher=slurm", "launcher.nodes=1:2"))  # the full-size job's batch: 32 x 2 x 2
    assert p is not None and p.global_batch == 128 and p.world_sizes() == [2, 4]
    assert elastic.plan(run_of("launcher=slurm", "launcher.nodes=2")) is None


def test_the_lr_is_scaled_as_for_the_configured_batch_on_every_size() -> None:
    configured = run_of(*ACROSS, "launcher.nproc=1", "launcher.nnodes=1:2", "data.global_batch_size=64")
    factors = set()
    for world in (1, 2, 1):  # and back: a world size's run keeps what the user configured
        run = elastic.apply(configured, world)
        assert run.data.batch_size * world == 64 and run.configured_batch_size == 32
        factors.add(elastic.scaling_world_size(run, world))
        assert elastic.apply(run, 2).data.batch_size == 32  # applied again (a rank, after the driver)
    assert factors == {2.0}  # 64 / data.batch_size 32, as a 2-rank run without a global batch scales


def test_a_world_sizes_batch_leaves_the_configured_run_as_it_was() -> None:
    run = run_of(*ACROSS, "launcher.nproc=1", "launcher.nnodes=1:2")  # MAX's global batch: 32 x 2
    sized = elastic.apply(run, 1)
    assert (sized.data.batch_size, sized.configured_batch_size) == (64, 32)
    assert (run.data.batch_size, run.configured_batch_size) == (32, 32)  # not changed under the caller
    assert elastic.plan(sized) == elastic.plan(run)  # the same plan, from what the user configured
    assert elastic.scaling_world_size(sized, 1) == 2.0


def test_a_data_option_of_ones_own_gets_the_schemas_batch(tmp_path: Path) -> None:
    # An option that does not extend dtf's schema gets its defaults when typed (data.batch_size 32):
    # the plan reads the typed config, not the option as composed (which has no batch_size).
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "own.yaml").write_text("kind: loader\ndataset:\n  _target_: dtf.data.datasets.digits\n")
    cfg = compose_dtf("data=own", *ACROSS, "launcher.nnodes=1:2", config_dir=tmp_path)
    p = elastic.plan(validate(cfg))
    assert p is not None and p.global_batch == 32 * 2 * 2 and p.world_sizes() == [2, 4]


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
    sized = elastic.apply(run, 6)
    assert sized.data.batch_size == 16 and sized.data.canonical_partitions == p.partitions
    assert elastic.plan(sized) == p and run.data.canonical_partitions == "auto"


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
        (["launcher=slurm", "launcher.nodes=3:2"], "launcher.nodes=3:2 is invalid: give the job's number of nodes"),
        (["launcher=slurm", "launcher.nodes=0:2"], "launcher.nodes=0:2 is invalid: give the job's number of nodes"),
        (
            ["launcher=slurm", "launcher.nodes=1:2", "launcher.tasks_per_node=3", "data.global_batch_size=64"],
            "launcher.nodes=1:2: no world size of this run (3, 6 ranks, x trainer.grad_accum_steps=1) divides",
        ),
        (
            ["launcher=slurm", "+launcher.rdzv_configs.join_timeout=5"],
            "launcher.rdzv_configs.join_timeout: a SLURM job of a fixed size has no rendezvous",
        ),
        (
            ["launcher=slurm", "launcher.nodes=1:2", "+launcher.rdzv_configs.wait=5"],
            "launcher.rdzv_configs.wait is not",
        ),
        (["launcher=spark", "+launcher.nnodes=1:2"], "launcher.nnodes"),
    ],
)
def test_bad_elastic_settings_are_refused_in_one_line(overrides: list[str], line: str) -> None:
    with initialize_config_module("dtf.conf", version_base="1.3"):
        launcher = any(o.startswith("launcher=") for o in overrides)
        cfg = compose("config", overrides=overrides if launcher else [*ACROSS, *overrides])
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


# An elastic SLURM job's nodes (dtf.launch.slurm.run_as_node) and what the driver reads from them.
# The loss of a node itself is tests/e2e/test_multinode.py's (real SLURM on two hosts); what a node
# does when too few nodes are left cannot be brought about there: the job starts on MAX nodes, and
# two hosts leave no MIN below MAX to fall under but 1, which always meets.


def _elastic_node(monkeypatch: pytest.MonkeyPatch, node: int, *overrides: str) -> tuple[object, list[list[str]]]:
    import submitit

    from dtf.config.schema import CheckpointConfig
    from dtf.errors import TooFewNodes
    from dtf.launch import local, slurm

    def too_few(self: object, fn: object, cfg: object, run_dir: str) -> None:
        raise TooFewNodes("fewer than 2 node(s) met")

    class Job:
        @property
        def hostnames(self) -> list[str]:
            return ["n1", "n2", "n3"]

    ran: list[list[str]] = []
    monkeypatch.setattr(local.LocalLauncher, "launch", too_few)
    monkeypatch.setattr(submitit, "JobEnvironment", Job)
    monkeypatch.setattr(slurm.subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    for key, value in {"SLURM_NODEID": node, "SLURM_JOB_ID": 7, "SLURM_STEP_ID": 0}.items():
        monkeypatch.setenv(key, str(value))
    c = run_of("launcher=slurm", "launcher.nodes=2:3", "launcher.tasks_per_node=1", *overrides).launcher
    assert isinstance(c, slurm.SlurmLauncherConfig)
    try:
        return slurm.run_as_node(lambda cfg, run_dir: None, None, "/nonexistent", c, CheckpointConfig()), ran  # type: ignore[arg-type]
    except SystemExit as e:
        return e, ran


def test_too_few_nodes_left_requeue_an_elastic_slurm_job_from_its_first_node(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtf.results import EXIT_STOPPED

    first, ran = _elastic_node(monkeypatch, 0)
    assert isinstance(first, SystemExit) and first.code == EXIT_STOPPED and ran == [["scontrol", "requeue", "7"]]
    other, ran = _elastic_node(monkeypatch, 1)  # the same error there: it leaves the requeue to the first
    assert isinstance(other, SystemExit) and other.code == EXIT_STOPPED and ran == []


def test_too_few_nodes_left_without_requeue_end_the_job_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtf.launch.slurm import NodeFailed

    failed, ran = _elastic_node(monkeypatch, 0, "launcher.requeue=false")
    assert isinstance(failed, NodeFailed) and not failed.user_error and ran == []
    assert failed.message == (
        "fewer than 2 node(s) of SLURM job 7 (launcher.nodes=2:3) met within 600 s "
        "(launcher.rdzv_configs.join_timeout), and launcher.requeue=false: the run stopped, and it has no "
        "checkpoint; the same command continues it"
    )


def test_the_driver_takes_rank_0s_result_from_whichever_node_ran_it(tmp_path: Path) -> None:
    from submitit.core.utils import JobPaths, cloudpickle_dump

    from dtf.errors import RankFailedError, UserError
    from dtf.launch.slurm import NodeFailed, elastic_result
    from dtf.results import Finished

    paths = [JobPaths(tmp_path, "7", task_id=i) for i in range(3)]  # the third node was lost: no result
    cloudpickle_dump(("success", None), paths[0].result_pickle)
    cloudpickle_dump(("success", Finished({"world_size": 1})), paths[1].result_pickle)
    assert elastic_result("7", paths) == Finished({"world_size": 1})
    cloudpickle_dump(("success", NodeFailed("launcher.nodes: bad", user_error=True)), paths[1].result_pickle)
    with pytest.raises(UserError) as err:
        elastic_result("7", paths)
    assert str(err.value) == "launcher.nodes: bad" and not isinstance(
        err.value, RankFailedError
    )  # exit status 2, as a user error on the driver
    paths[1].result_pickle.unlink()
    with pytest.raises(RankFailedError, match="without a result from rank 0's node"):
        elastic_result("7", paths)
