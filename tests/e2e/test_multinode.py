"""launcher=local across nodes: "hosts" made of network namespaces on a bridge (scripts/local-hosts.sh),
each with its own network stack and address in 198.18.0.0/15, one `python -m dtf` per host, as
torchrun's multi-node runs start. The filesystem (and so the run directory) is shared, as on a
cluster with NFS."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SHORT_RUN, TEST_DEFAULTS, DtfRun, dtf_env, run_dtf
from tests.helpers.clusters import SCRIPTS, preempt_and_requeue, script_cluster


@pytest.fixture(scope="module")
def hosts() -> Iterator[list[str]]:
    with script_cluster("local-hosts.sh", "DTF_HOSTS") as names:
        yield names.strip('"').split()


def run_on_hosts(
    hosts: list[str], args: list[str], run_dir: Path, timeout: float = 180, per_node: list[list[str]] | None = None
) -> list[DtfRun]:
    """`python -m dtf <args>` on each host at once (plus per_node[i] on host i), node_rank = the
    host's place: the first host hosts the rendezvous. Returns each node's outcome."""
    common = [
        *TEST_DEFAULTS,
        *args,
        f"launcher.nnodes={len(hosts)}",
        f"launcher.rdzv_endpoint={hosts[0]}:29500",
        f"hydra.run.dir={run_dir}",
    ]
    procs = []
    for node, host in enumerate(hosts):
        cmd = ["bash", str(SCRIPTS / "local-hosts.sh"), "run", host, sys.executable, "-m", "dtf", *common]
        cmd += [f"launcher.node_rank={node}", *(per_node[node] if per_node else [])]
        log = run_dir.parent / f"{run_dir.name}.{host}"
        with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:  # the child keeps its own copies
            procs.append((subprocess.Popen(cmd, stdout=out, stderr=err, env=dtf_env()), log))
    runs = []
    for proc, log in procs:
        try:
            code = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        runs.append(DtfRun(code, Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text(), run_dir))
    return runs


def _sockets(report_dir: Path) -> list[tuple[int, str, int]]:
    """What the ranks' ListeningSockets saw their run listen on (each from its own host)."""
    import json

    return sorted({tuple(s) for f in report_dir.glob("sockets_*.json") for s in json.loads(f.read_text())})


def test_two_ranks_on_each_of_two_hosts_are_four_ranks_on_one(hosts: list[str], tmp_path: Path) -> None:
    # The model also lists the sockets each run listens on, from its ranks: the stores (the
    # rendezvous', rank 0's process group's) and gloo listen on loopback on one host, and on the
    # address that reaches the other hosts across hosts, never on every interface.
    (tmp_path / "one_sockets").mkdir()
    (tmp_path / "two_sockets").mkdir()
    model = ["model._target_=user_models.ListeningSockets"]
    one = run_dtf(
        [*SHORT_RUN, *model, f"+model.report_dir={tmp_path / 'one_sockets'}", "launcher.nproc=4"], tmp_path / "one"
    )
    assert one.returncode == 0, one.stderr[-3000:]
    runs = run_on_hosts(
        hosts,
        [*SHORT_RUN, *model, f"+model.report_dir={tmp_path / 'two_sockets'}", "launcher.nproc=2"],
        tmp_path / "two",
    )
    for run in runs:
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    s = runs[0].summary
    assert s["world_size"] == 4 and s["config_consistent"] and s["params_sha256_consistent"]
    assert s["params_sha256"] == one.summary["params_sha256"]  # bit for bit
    # the other node says where rank 0's summary is, and does not claim the node-specific keys differ
    assert "rank 0's node writes" in runs[1].stdout and "differs from rank 0's" not in runs[1].stdout
    on_one = _sockets(tmp_path / "one_sockets")
    assert len({pid for pid, _, _ in on_one}) >= 5 and {a for _, a, _ in on_one} == {"127.0.0.1"}, on_one
    across = _sockets(tmp_path / "two_sockets")
    addresses = {a for _, a, _ in across}
    assert addresses and all(a.startswith("198.18.0.") for a in addresses), across  # scripts/local-hosts.sh's
    assert "nodes connected over eth0 (198.18.0.1)" in runs[0].stdout, runs[0].stdout[-2000:]


def test_a_node_whose_config_differs_runs_rank_0s_and_says_so(hosts: list[str], tmp_path: Path) -> None:
    # Each driver resolves a config, but every rank trains with rank 0's: one run, one config.
    runs = run_on_hosts(hosts, [*SHORT_RUN, "launcher.nproc=1"], tmp_path / "run", per_node=[[], ["optimizer.lr=0.5"]])
    for run in runs:
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    told = [i for i, run in enumerate(runs) if "this node's config differs from rank 0's" in run.stdout]
    assert len(told) == 1, [run.stdout[-1000:] for run in runs]
    rank0_lr = 0.5 if told == [0] else 1e-3  # the default job's Adam
    s = runs[0].summary
    assert s["config_consistent"] and s["lr_final"] == pytest.approx(rank0_lr * 2)  # linear scaling, 2 ranks


def test_losing_a_host_ends_the_run_in_seconds_naming_the_host(hosts: list[str], tmp_path: Path) -> None:
    # Every process of the second host is killed mid-run (as when the machine dies): the first
    # host's rank sees its connection close; the run ends at once with one line naming the lost
    # node and its ranks, not after the collective timeout, and never hangs.
    import os
    import re
    import signal
    import time

    run_dir = tmp_path / "run"
    long_run = [
        "launcher.nproc=1",
        "trainer.max_steps=100000",
        "data.dataset.num_points=20000",
        "trainer.dist_timeout_s=60",
    ]
    common = [*TEST_DEFAULTS, *long_run, "launcher.nnodes=2", f"launcher.rdzv_endpoint={hosts[0]}:29500"]
    script = str(SCRIPTS / "local-hosts.sh")
    procs = [
        subprocess.Popen(
            [
                "bash",
                script,
                "run",
                host,
                sys.executable,
                "-m",
                "dtf",
                *common,
                f"launcher.node_rank={node}",
                f"hydra.run.dir={run_dir}",
            ],
            stdout=subprocess.PIPE if node == 0 else subprocess.DEVNULL,
            stderr=subprocess.PIPE if node == 0 else subprocess.DEVNULL,
            text=True,
            env=dtf_env(),
        )
        for node, host in enumerate(hosts)
    ]
    try:
        deadline = time.monotonic() + 120
        while not list(run_dir.glob("logs/nodes.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # training
        pids = subprocess.run(["ip", "netns", "pids", hosts[1]], capture_output=True, text=True).stdout.split()
        killed = time.monotonic()
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        _, err = procs[0].communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert procs[0].returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.match(rf"dtf: error: lost the node {hosts[1]} \(198\.18\.0\.2\), ranks 1: ", last), last
    assert took < 30, took  # seen here: ~2 s (the peer's kernel closes its sockets)


@pytest.fixture(scope="module")
def spark_on_hosts(hosts: list[str]) -> Iterator[str]:
    """A Spark standalone master on the first host and a worker on each (scripts/local-spark.sh)."""
    env = {"DTF_SPARK_HOSTS": " ".join(hosts), "DTF_SPARK_DIR": "/tmp/dtf-spark-hosts"}
    with script_cluster("local-spark.sh", "SPARK_MASTER_URL", env) as url:
        yield url


def test_spark_ranks_on_two_hosts_are_two_ranks_on_one(
    hosts: list[str], spark_on_hosts: str, tmp_path: Path, short_local_run: DtfRun
) -> None:
    # The driver on the first host; the barrier stage's two tasks land on the two workers, one per
    # host, and meet at rank 0's host over the bridge.
    run_dir = tmp_path / "run"
    cmd = ["bash", str(SCRIPTS / "local-hosts.sh"), "run", hosts[0], sys.executable, "-m", "dtf"]
    args = [
        *TEST_DEFAULTS,
        *SHORT_RUN,
        "launcher=spark",
        f"launcher.master={spark_on_hosts}",
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, env=dtf_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    import json

    addresses = json.loads((run_dir / "logs" / "nodes.json").read_text())["ranks"]
    assert sorted(addresses.values()) == ["198.18.0.1", "198.18.0.2"]  # one rank on each host
    s = DtfRun(0, "", "", run_dir).summary
    assert s["launcher"] == "spark" and s["params_sha256"] == short_local_run.summary["params_sha256"]


@pytest.fixture(scope="module")
def slurm_on_hosts(hosts: list[str]) -> Iterator[str]:
    """A SLURM cluster with a node on each host and slurmctld on the first (scripts/local-slurm.sh)."""
    env = {"DTF_SLURM_HOSTS": " ".join(hosts), "DTF_SLURM_DIR": "/tmp/dtf-slurm-hosts", "DTF_SLURM_PORT": "6827"}
    with script_cluster("local-slurm.sh", "SLURM_CONF", env) as conf:
        yield conf


def on_first_host(hosts: list[str], conf: str, *cmd: str) -> list[str]:
    """A command run on the first host, where the cluster's controller is reachable."""
    return ["env", f"SLURM_CONF={conf}", "bash", str(SCRIPTS / "local-hosts.sh"), "run", hosts[0], *cmd]


def test_a_slurm_job_over_two_hosts_is_two_ranks_on_one(
    hosts: list[str], slurm_on_hosts: str, tmp_path: Path, short_local_run: DtfRun
) -> None:
    run_dir = tmp_path / "run"
    args = [*TEST_DEFAULTS, *SHORT_RUN, "launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1"]
    cmd = on_first_host(hosts, slurm_on_hosts, sys.executable, "-m", "dtf", *args, f"hydra.run.dir={run_dir}")
    done = subprocess.run(cmd, capture_output=True, text=True, env=dtf_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    import json

    addresses = json.loads((run_dir / "logs" / "nodes.json").read_text())["ranks"]
    assert sorted(addresses.values()) == ["198.18.0.1", "198.18.0.2"]  # one task on each node
    s = DtfRun(0, "", "", run_dir).summary
    assert s["launcher"] == "slurm" and s["params_sha256"] == short_local_run.summary["params_sha256"]


def test_a_preempted_two_node_job_requeues_and_ends_as_the_uninterrupted_run(
    hosts: list[str], slurm_on_hosts: str, tmp_path: Path
) -> None:
    import json
    import re

    args = ["model._target_=user_models.FailingModel", "+model.fail_rank=-1", *SHORT_RUN, "trainer.max_steps=100"]
    straight = run_dtf(args, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    slurm = ["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1", "+model.delay_s=0.05"]
    cmd = on_first_host(hosts, slurm_on_hosts, sys.executable, "-m", "dtf", *TEST_DEFAULTS, *args, *slurm)
    run_dir = tmp_path / "preempted"
    text = preempt_and_requeue(
        cmd, run_dir, tmp_path / "preempted.out", lambda c: on_first_host(hosts, slurm_on_hosts, *c)
    )
    stopped = re.search(r"dtf: stopped at step (\d+); requeued SLURM job", text)
    assert stopped, text[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == int(stopped.group(1)) and summary["slurm_restarts"] == 1
    assert sorted(json.loads((run_dir / "logs" / "nodes.json").read_text())["ranks"].values()) == [
        "198.18.0.1",
        "198.18.0.2",
    ]
    assert summary["params_sha256"] == straight.summary["params_sha256"]
