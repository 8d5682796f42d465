"""Horovod's examples/pytorch/pytorch_mnist.py (recipes/horovod_pytorch_mnist.py: digits for
MNIST, the import changed) under three launchers: dtf's local one (`python -m dtf.horovod -np 2
python ...`), `srun -n 2` on the project's SLURM cluster and Open MPI's `mpirun -n 2`. hvd.init()
finds its rank and rendezvous under each; the same seed gives the same parameters, bit for bit.
And horovodrun's form for a user's own tests, `python -m dtf.horovod -np 2 python -m pytest ...`."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.helpers.clusters import run_script, script_cluster, unavailable
from tests.helpers.run_command import dtf_command, run_command

SCRIPT = REPO / "recipes" / "horovod_pytorch_mnist.py"
ARGS = ["--epochs", "1", "--batch-size", "16", "--lr", "0.05"]


def run(cmd: list[str], cwd: Path, out: str, env: dict[str, str] | None = None) -> str:
    return run_command(
        [*cmd, sys.executable, str(SCRIPT), *ARGS, "--save-model", out], cwd=cwd, env=env, timeout=300
    ).stdout


def accuracy(stdout: str) -> float:
    found = re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+)%", stdout)
    assert len(found) == 1, stdout[-2000:]  # printed by rank 0 only
    return float(found[0])


def same_parameters(a: Path, b: Path) -> bool:
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    where = tmp_path_factory.mktemp("local")
    stdout = run(dtf_command("-np", "2", module="dtf.horovod"), where, str(where / "params.pt"))
    return where / "params.pt", accuracy(stdout)


@pytest.fixture(scope="module")
def mpirun() -> list[str]:
    installed = run_script("local-mpi.sh", "install")
    lines = [line for line in installed.stdout.splitlines() if line.startswith("export DTF_MPIRUN=")]
    if installed.returncode != 0 or not lines:
        unavailable(f"scripts/local-mpi.sh install failed: {installed.stderr.strip()[-500:]}")
    return shlex.split(lines[-1].split("=", 1)[1].strip('"'))


@pytest.fixture(scope="module")
def slurm() -> Iterator[str]:
    with script_cluster("local-slurm.sh", "SLURM_CONF") as conf:
        yield conf


def test_under_dtfs_local_launcher_it_trains(local: tuple[Path, float]) -> None:
    assert local[1] > 50  # one epoch on 2 ranks; chance is 10%


def test_under_mpirun_it_trains_the_same_parameters(
    tmp_path: Path, mpirun: list[str], local: tuple[Path, float]
) -> None:
    stdout = run([*mpirun, "-n", "2"], tmp_path, str(tmp_path / "params.pt"))
    assert same_parameters(tmp_path / "params.pt", local[0]) and accuracy(stdout) == local[1]
    assert not list(tmp_path.glob("dtf-horovod-*")), "the rendezvous file is left behind"


def test_under_srun_it_trains_the_same_parameters(tmp_path: Path, slurm: str, local: tuple[Path, float]) -> None:
    cmd = ["srun", "-n", "2", "--kill-on-bad-exit=1"]
    stdout = run(cmd, tmp_path, str(tmp_path / "params.pt"), {"SLURM_CONF": slurm})
    assert same_parameters(tmp_path / "params.pt", local[0]) and accuracy(stdout) == local[1]


USERS_TEST = """
import torch
import torch.distributed as dist

import dtf.horovod as hvd


def test_allreduce_on_every_rank():
    hvd.init()
    assert hvd.size() == 2
    tensor = torch.arange(4.0) * (hvd.rank() + 1)
    direct = tensor.clone()
    dist.all_reduce(direct)
    assert torch.equal(hvd.allreduce(tensor, op=hvd.Sum), direct)
    print(f"rank {hvd.rank()} of {hvd.size()} checked", flush=True)
"""


def test_python_dash_m_runs_a_users_tests_on_every_rank(tmp_path: Path) -> None:
    """horovodrun's `-np 2 python -m pytest test_x.py`: pytest runs on each rank, in the working
    directory; both ranks pass (each prints its line, seen with tee_all_ranks)."""
    (tmp_path / "test_users.py").write_text(USERS_TEST)
    cmd = dtf_command(
        "-np", "2", "launcher.tee_all_ranks=true", "python", "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
        "test_users.py", module="dtf.horovod",
    )  # fmt: skip
    out = run_command(cmd, cwd=tmp_path, timeout=180).stdout
    assert "rank 0 of 2 checked" in out and "rank 1 of 2 checked" in out, out[-3000:]
    assert out.count("1 passed") == 2, out[-3000:]
