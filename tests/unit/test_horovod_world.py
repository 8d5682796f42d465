"""dtf.horovod in this process: where hvd.init() finds its rank under each launcher (from the
variables each one sets, as seen on this machine), the mpirun rendezvous, and install()."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dtf.horovod import world

OMPI_TWO_RANKS = {  # what Open MPI 4.1's mpirun -n 2 gave rank 1 here (one node)
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_MCA_orte_num_nodes": "1",
    "OMPI_MCA_ess_base_jobid": "1747648513",
    "OMPI_MCA_orte_hnp_uri": "1747648512.0;tcp://127.0.0.1:42277;tcp6://[fd00::2]:45413",
}
LAUNCHER_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in [
        *LAUNCHER_VARS,
        "GROUP_WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_STEP_ID",
        "SUBMITIT_EXECUTOR",
        *OMPI_TWO_RANKS,
    ]:
        monkeypatch.setenv(key, "")  # recorded, so that what the code sets is undone too
        monkeypatch.delenv(key)
    return monkeypatch


def test_torchruns_variables_give_the_place(clean_env: pytest.MonkeyPatch) -> None:
    env = dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", MASTER_ADDR="n1", MASTER_PORT="1")
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert world.detect() == world.World(5, 8, 1, 4, 1, 2, "torchrun")


def test_slurms_variables_give_the_place_and_a_port_of_the_step(clean_env: pytest.MonkeyPatch) -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "17",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_STEP_NODELIST": "node[1-2]",
    }
    for key, value in env.items():
        clean_env.setenv(key, value)
    found = world.detect()
    assert found == world.World(3, 4, 1, 2, 1, 2, "slurm")
    world.export_rendezvous(found)
    from dtf.launch.slurm import step_port

    assert sys.modules["os"].environ["MASTER_ADDR"] == "node1"
    assert sys.modules["os"].environ["MASTER_PORT"] == str(step_port())


def test_mpiruns_ranks_meet_through_a_file_in_the_jobs_session_directory(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for key, value in OMPI_TWO_RANKS.items():
        clean_env.setenv(key, value)
    clean_env.setenv("OMPI_MCA_orte_jobfam_session_dir", str(tmp_path))
    assert world.detect() == world.World(1, 2, 1, 2, 0, 1, "mpirun")
    address, port = world.mpirun_rendezvous(0, 1)  # rank 0: a free port, published
    assert (
        address == "127.0.0.1" and (tmp_path / "dtf-horovod-1747648513.rendezvous").read_text() == f"127.0.0.1:{port}"
    )
    assert world.mpirun_rendezvous(1, 1) == (address, port)  # rank 1 reads it


def test_on_several_nodes_rank_0_publishes_its_address_towards_mpirun_in_the_working_directory(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for key, value in OMPI_TWO_RANKS.items():
        clean_env.setenv(key, value)
    clean_env.setenv("OMPI_MCA_orte_num_nodes", "2")
    clean_env.setenv("OMPI_MCA_initial_wdir", str(tmp_path))
    address, port = world.mpirun_rendezvous(0, 2)
    assert address == "127.0.0.1"  # the route to mpirun's address in orte_hnp_uri
    assert world.mpirun_rendezvous(1, 2) == (address, port)
    assert (tmp_path / "dtf-horovod-1747648513.rendezvous").exists()


def test_given_master_addr_and_port_win_under_mpirun(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in {**OMPI_TWO_RANKS, "MASTER_ADDR": "node7", "MASTER_PORT": "29500"}.items():
        clean_env.setenv(key, value)
    world.export_rendezvous(world.detect())
    environ = sys.modules["os"].environ
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"], environ["RANK"]) == ("node7", "29500", "1")


def test_install_makes_horovod_torch_this_api(monkeypatch: pytest.MonkeyPatch) -> None:
    import dtf.horovod

    monkeypatch.delitem(sys.modules, "horovod", raising=False)
    monkeypatch.delitem(sys.modules, "horovod.torch", raising=False)
    assert dtf.horovod.install() and dtf.horovod.install()  # once is enough, twice is fine
    import horovod.torch as hvd  # type: ignore[import-not-found]

    assert hvd is dtf.horovod and hvd.DistributedOptimizer is dtf.horovod.DistributedOptimizer
    monkeypatch.delitem(sys.modules, "horovod")
    monkeypatch.delitem(sys.modules, "horovod.torch")
