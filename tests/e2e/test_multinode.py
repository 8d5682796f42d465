"""launcher=local across nodes: "hosts" made of network namespaces on a bridge (scripts/local-hosts.sh),
each with its own network stack and address in 198.18.0.0/15, one `python -m dtf` per host, as
torchrun's multi-node runs start. The filesystem (and so the run directory) is shared, as on a
cluster with NFS."""

from __future__ import annotations

import concurrent.futures
import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SHORT_RUN
from tests.e2e.test_elastic import max_difference
from tests.helpers.clusters import (
    SCRIPTS,
    preempt,
    preempt_and_requeue,
    run_script,
    script_cluster,
    start_requeued,
)
from tests.helpers.run_command import (
    HELPERS,
    TEST_DEFAULTS,
    DtfRun,
    Started,
    dtf_command,
    run_command,
    run_dtf,
    start_command,
)

LOCAL_HOSTS = ["bash", str(SCRIPTS / "local-hosts.sh"), "run"]  # + a host: what runs a command on it


@pytest.fixture(scope="module")
def all_hosts() -> Iterator[list[str]]:
    """Three hosts (scripts/local-hosts.sh); the SLURM cluster has a node on each."""
    with script_cluster("local-hosts.sh", "DTF_HOSTS", args=["3"]) as names:
        yield names.strip('"').split()


@pytest.fixture(scope="module")
def hosts(all_hosts: list[str]) -> list[str]:
    """The two hosts most tests run on."""
    return all_hosts[:2]


def run_on_hosts(
    hosts: list[str], args: list[str], run_dir: Path, timeout: float = 180, per_node: list[list[str]] | None = None
) -> list[DtfRun]:
    """`python -m dtf <args>` on each host at once (plus per_node[i] on host i), node_rank = the
    host's place: the first host hosts the rendezvous. Returns each node's outcome (exit status 0)."""
    common = [
        *TEST_DEFAULTS,
        *args,
        f"launcher.nnodes={len(hosts)}",
        f"launcher.rdzv_endpoint={hosts[0]}:29500",
        f"hydra.run.dir={run_dir}",
    ]
    with contextlib.ExitStack() as started:
        procs = []
        for node, host in enumerate(hosts):
            node_args = [*common, f"launcher.node_rank={node}", *(per_node[node] if per_node else [])]
            log = run_dir.parent / f"{run_dir.name}.{host}"
            cmd = dtf_command(*node_args, prefix=[*LOCAL_HOSTS, host])
            procs.append(started.enter_context(start_command(cmd, Path(f"{log}.out"), err=Path(f"{log}.err"))))
        return [DtfRun(p.finish(timeout=timeout), p.output(), p.error_output(), run_dir) for p in procs]


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
    runs = run_on_hosts(
        hosts,
        [*SHORT_RUN, *model, f"+model.report_dir={tmp_path / 'two_sockets'}", "launcher.nproc=2"],
        tmp_path / "two",
    )
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
    with contextlib.ExitStack() as started:
        procs = [
            started.enter_context(
                start_command(
                    dtf_command(
                        *common, f"launcher.node_rank={node}", f"hydra.run.dir={run_dir}", prefix=[*LOCAL_HOSTS, host]
                    ),
                    tmp_path / f"{host}.out",
                    err=tmp_path / f"{host}.err",
                )
            )
            for node, host in enumerate(hosts)
        ]
        deadline = time.monotonic() + 120
        while not list(run_dir.glob("logs/nodes.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # training
        pids = subprocess.run(["ip", "netns", "pids", hosts[1]], capture_output=True, text=True).stdout.split()
        killed = time.monotonic()
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        procs[0].finish(1, timeout=60)
        took = time.monotonic() - killed
    err = procs[0].error_output()
    last = err.strip().splitlines()[-1]
    assert re.match(rf"dtf: error: lost the node {hosts[1]} \(198\.18\.0\.2\), ranks 1: ", last), last
    assert took < 30, took  # seen here: ~2 s (the peer's kernel closes its sockets)


def test_a_host_cut_off_from_the_others_ends_by_itself_and_says_so(hosts: list[str], tmp_path: Path) -> None:
    # The second host's link to the others goes down mid-run (a switch port, a cable): no process
    # dies and no connection closes. Each host must end within its timeouts (a collective's 15 s,
    # then the cut-off node's grace and dial): the one with the rendezvous naming the stalled
    # collective, the one cut off saying that it is.
    import time

    run_dir = tmp_path / "run"
    long_run = ["launcher.nproc=1", "trainer.max_steps=100000", "data.dataset.num_points=20000"]
    common = [*TEST_DEFAULTS, *long_run, "trainer.dist_timeout_s=15", "launcher.nnodes=2"]
    common += [f"launcher.rdzv_endpoint={hosts[0]}:29500", f"hydra.run.dir={run_dir}"]
    link = f"{hosts[1]}v"  # its veth's end on the bridge (scripts/local-hosts.sh)
    with contextlib.ExitStack() as started:
        procs = [
            started.enter_context(
                start_command(
                    dtf_command(*common, f"launcher.node_rank={node}", prefix=[*LOCAL_HOSTS, host]),
                    tmp_path / f"{host}.out",
                    err=tmp_path / f"{host}.err",
                )
            )
            for node, host in enumerate(hosts)
        ]
        deadline = time.monotonic() + 120
        while not list(run_dir.glob("logs/nodes.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # training
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        cut = time.monotonic()
        ended = []
        try:
            for proc in procs:
                proc.finish(1, timeout=90)
                ended.append(time.monotonic() - cut)  # by when it had ended
        finally:
            subprocess.run(["ip", "link", "set", link, "up"], check=True)  # the next tests need it
    reached, cut_off = (p.error_output().strip().splitlines()[-1] for p in procs)
    assert reached.startswith("dtf: error: rank "), reached
    assert "Timed out waiting 15000ms" in reached, reached
    assert cut_off.startswith("dtf: error: this node (198.18.0.2) is cut off from the run: its ranks ended ("), cut_off
    assert cut_off.endswith(
        f"later the rendezvous host {hosts[0]}:29500 (launcher.rdzv_endpoint) does not answer: the network between "
        "the nodes was cut, or that node was lost; the same command on every node continues from the newest checkpoint"
    ), cut_off
    assert "Traceback" not in procs[1].error_output()
    assert max(ended) < 60, ended  # 15 s collective timeout + 10 s grace + 5 s dial, with room on a busy machine


@contextlib.contextmanager
def links_shaped(rate: str) -> Iterator[None]:
    """Every host's link to the others at `rate`, both ways (scripts/local-hosts.sh shape: tc's tbf);
    unshaped again after, whatever happens."""
    shape = ["bash", str(SCRIPTS / "local-hosts.sh"), "shape"]
    subprocess.run([*shape, rate], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run([*shape, "off"], check=True, capture_output=True)


def test_auto_shards_inside_each_host_when_the_links_between_them_are_slow(hosts: list[str], tmp_path: Path) -> None:
    # 10 Mbit/s between the hosts, loopback inside each: strategy=auto measures both on the run's own
    # groups and takes MiCS with G = 2, the ranks of one host (the only all-reduce that crosses is
    # of each rank's half of the gradients). It ends at the parameters of DDP on 4 ranks of one host.
    small = ["model=deep_mlp", "model.depth=4", "trainer.max_steps=4", "data.dataset.num_points=2000"]
    small.append("data.dataset.num_test=200")
    with links_shaped("10mbit"):
        runs = run_on_hosts(hosts, [*small, "strategy=auto", "launcher.nproc=2"], tmp_path / "auto")
    ddp = run_dtf([*small, "strategy=ddp", "launcher.nproc=4"], tmp_path / "ddp")
    s = runs[0].summary
    choice = s["strategy_choice"]
    assert (s["strategy"], choice["plan"], choice["nodes"], choice["ranks_per_node"]) == ("mics", "mics G=2", 2, 2)
    assert s["strategy_settings"]["name"] == "auto"  # as configured; strategy says what ran
    assert 10e6 / 8 / 2 <= choice["across_bytes_per_s"] <= 10e6 / 8 * 2, choice  # the shaping, within 2x
    assert choice["inside_bytes_per_s"] > 20 * choice["across_bytes_per_s"], choice  # loopback: far faster
    assert "dtf: strategy=auto: measured across nodes" in runs[0].stdout and "chose mics G=2" in runs[0].stdout
    assert max_difference(runs[0], ddp) < 1e-5


def test_the_topology_benchmarks_smoke_run_measures_the_formulas_bytes_and_ends_at_ddps_parameters(
    hosts: list[str], tmp_path: Path
) -> None:
    # benchmarks/topology.py --smoke (ddp, fsdp, and mics G=2 with its gradients crossing in fp32 and
    # in bf16, on deep_mlp, 100 Mbit/s across the hosts), so that it cannot rot: the bytes each host
    # sent across per step, read from its veth's counters, are the formula's within 10% (bf16: half),
    # every plan ends at DDP's parameters (bf16: within its tolerance), and the links are unshaped
    # again after it.
    import json
    import sys

    figures = tmp_path / "smoke.json"
    bench = [sys.executable, str(SCRIPTS.parent / "benchmarks" / "topology.py"), "--smoke", "--json", str(figures)]
    run_command(bench, timeout=600, cwd=tmp_path)
    rows = json.loads(figures.read_text())["rows"]
    assert [r["plan"] for r in rows] == ["ddp", "fsdp", "mics G=2", "mics G=2 bf16"]
    for r in rows:
        assert 0.9 <= r["bytes_measured"] / r["bytes_formula"] <= 1.1, r
        assert r["equal_to_ddp"], r
    for host in hosts:
        qdiscs = subprocess.run(["tc", "qdisc", "show", "dev", f"{host}v"], capture_output=True, text=True).stdout
        assert "tbf" not in qdiscs, qdiscs


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
    spark = ["launcher=spark", f"launcher.master={spark_on_hosts}", f"hydra.run.dir={run_dir}"]
    run_command(dtf_command(*TEST_DEFAULTS, *SHORT_RUN, *spark, prefix=[*LOCAL_HOSTS, hosts[0]]), timeout=300)
    import json

    addresses = json.loads((run_dir / "logs" / "nodes.json").read_text())["ranks"]
    assert sorted(addresses.values()) == ["198.18.0.1", "198.18.0.2"]  # one rank on each host
    s = DtfRun(0, "", "", run_dir).summary
    assert s["launcher"] == "spark" and s["params_sha256"] == short_local_run.summary["params_sha256"]


@pytest.fixture(scope="module")
def slurm_on_hosts(all_hosts: list[str]) -> Iterator[str]:
    """A SLURM cluster with a node on each host and slurmctld on the first (scripts/local-slurm.sh).
    A job of 2 nodes gets the first two."""
    with script_cluster("local-slurm.sh", "SLURM_CONF", slurm_hosts_env(all_hosts)) as conf:
        yield conf


def slurm_hosts_env(hosts: list[str]) -> dict[str, str]:
    return {"DTF_SLURM_HOSTS": " ".join(hosts), "DTF_SLURM_DIR": "/tmp/dtf-slurm-hosts", "DTF_SLURM_PORT": "6827"}


def on_first_host(hosts: list[str], conf: str, *cmd: str) -> list[str]:
    """A command run on the first host, where the cluster's controller is reachable."""
    return ["env", f"SLURM_CONF={conf}", "bash", str(SCRIPTS / "local-hosts.sh"), "run", hosts[0], *cmd]


def test_a_slurm_job_over_two_hosts_is_two_ranks_on_one(
    hosts: list[str], slurm_on_hosts: str, tmp_path: Path, short_local_run: DtfRun
) -> None:
    run_dir = tmp_path / "run"
    args = [*TEST_DEFAULTS, *SHORT_RUN, "launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1"]
    run_command(on_first_host(hosts, slurm_on_hosts, *dtf_command(*args, f"hydra.run.dir={run_dir}")), timeout=300)
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
    slurm = ["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1", "+model.delay_s=0.05"]
    cmd = on_first_host(hosts, slurm_on_hosts, *dtf_command(*TEST_DEFAULTS, *args, *slurm))
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


# Elastic membership (launcher.nnodes=MIN:MAX): one rank per host, a host's processes killed while
# it trains and its command started again; each run ends at the parameters of an uninterrupted
# 2-rank run (the same global batch, so the same samples in the same steps on 1 rank or 2).
G = 64
ELASTIC = [
    "model._target_=user_models.FailingModel",
    "+model.fail_rank=-1",
    "optimizer=sgd",
    "optimizer.lr=0.05",
    "+launcher.env.OMP_NUM_THREADS=1",  # one intra-op thread on every world size (tests/e2e/test_elastic.py)
]
# The rendezvous' waits shortened: for more nodes once MIN are there, and for a lost node's
# heartbeat (an agent that misses 3 beats 2 s apart is taken for dead: fewer, on a loaded machine,
# and a live node is dropped: its peers go on without it, and it forms a run of its own, which
# finds the run dir held and fails).
QUICK_RDZV = [
    "+launcher.rdzv_configs.last_call_timeout=2",
    "+launcher.rdzv_configs.keep_alive_interval=2",
    "+launcher.rdzv_configs.keep_alive_max_attempt=3",
]


def slow_steps(hold: Path) -> list[str]:
    """Training outlasts the kills and restarts while the file hold exists (the elastic runs only)."""
    hold.touch()
    return ["+model.delay_s=0.05", f"+model.slow_while={hold}"]


class ElasticNode:
    """One host's `python -m dtf` of an elastic run, killed (every process of it, as when the
    machine dies) and started again by the test."""

    def __init__(self, host: str, node_rank: int, args: list[str], log: Path) -> None:
        self.host, self.node_rank, self.args, self.log = host, node_rank, args, log
        self.starts = 0
        self.proc: Started | None = None

    def start(self) -> None:
        cmd = dtf_command(*self.args, f"launcher.node_rank={self.node_rank}", prefix=[*LOCAL_HOSTS, self.host])
        self.starts += 1
        self.proc = start_command(cmd, Path(f"{self.log}.{self.starts}.out"), err=Path(f"{self.log}.{self.starts}.err"))

    def kill(self) -> None:
        import psutil

        assert self.proc is not None
        tree = psutil.Process(self.proc.pid)
        everyone = [tree, *tree.children(recursive=True)]  # the ranks too (they start sessions of their own)
        for p in everyone:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(everyone, timeout=30)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()

    def output(self) -> str:
        return "".join(
            Path(f"{self.log}.{i}.{s}").read_text() for i in range(1, self.starts + 1) for s in ("out", "err")
        )


def _newest(run_dir: Path) -> tuple[int, int]:
    """(step, world size) of the run's newest committed checkpoint; (0, 0) before the first."""
    from dtf.train.checkpoint import committed, read_marker

    found = committed(run_dir / "checkpoints")
    if not found:
        return 0, 0
    marker = read_marker(found[0])
    return marker.step, marker.world_size


def _until(run_dir: Path, world: int, past: int, nodes: list[ElasticNode], timeout: float = 120) -> int:
    """Waits for a checkpoint of the given world size past a step; returns its step."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        step, size = _newest(run_dir)
        if size == world and step > past:
            return step
        if any(n.proc is not None and n.proc.poll() is not None for n in nodes[:1]):
            break
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint of {world} rank(s) past step {past}: " + nodes[0].output()[-3000:])


def start_elastic(
    hosts: list[str], args: list[str], run_dir: Path, port: int, nnodes: str = "1:2", global_batch: int = G
) -> list[ElasticNode]:
    """The second host first: its agent waits for the first, which hosts the rendezvous, so that
    the run starts on both (not on the first alone, then grows)."""
    import time

    common = [
        *TEST_DEFAULTS,
        *ELASTIC,
        *QUICK_RDZV,
        *args,
        "launcher.nproc=1",
        f"launcher.nnodes={nnodes}",
        f"data.global_batch_size={global_batch}",
        f"launcher.rdzv_endpoint={hosts[0]}:{port}",
        f"hydra.run.dir={run_dir}",
    ]
    nodes = [ElasticNode(host, i, common, run_dir.parent / f"{run_dir.name}.{host}") for i, host in enumerate(hosts)]
    nodes[1].start()
    time.sleep(1)
    nodes[0].start()
    return nodes


def lose_and_regain(nodes: list[ElasticNode], run_dir: Path, times: int, hold: Path) -> None:
    """The second host killed once the run trains on both hosts, its command started again once the
    first trains alone; `times` times. Then the run finishes at full speed."""
    step = 0
    for _ in range(times):
        step = _until(run_dir, 2, step + 10, nodes)
        nodes[1].kill()
        step = _until(run_dir, 1, step + 10, nodes)
        nodes[1].start()
        step = _until(run_dir, 2, step, nodes)
    hold.unlink()


def lose_below_min(nodes: list[ElasticNode], run_dir: Path) -> tuple[int, float]:
    """The second host killed once the run trains on both: the first's exit status, and how long it took."""
    import time

    _until(run_dir, 2, 10, nodes)
    nodes[1].kill()
    killed = time.monotonic()
    return nodes[0].wait(timeout=120), time.monotonic() - killed


def test_a_lost_host_leaves_and_rejoins_and_the_run_ends_as_the_uninterrupted_one(
    hosts: list[str], tmp_path: Path
) -> None:
    # In-memory data (lost and regained once) and Parquet written by pyarrow (twice: repeated
    # faults), at once on the same two hosts; each against its uninterrupted 2-rank run on one.
    from tests.helpers import user_datasets

    parquet = user_datasets.write_field_parquet(tmp_path / "field")
    kinds = {
        "memory": (["data.dataset.num_points=2400", "data.dataset.num_test=400", "trainer.max_steps=1500"], 1),
        "parquet": (["data=petastorm", f"data.path={parquet}", "trainer.max_steps=1500"], 2),
    }
    elastic = {
        kind: start_elastic(
            hosts,
            [*args, *slow_steps(tmp_path / f"{kind}.slow"), "checkpoint.every_n_steps=5"],
            tmp_path / kind,
            29510 + i,
        )
        for i, (kind, (args, _)) in enumerate(kinds.items())
    }
    # And a run whose MIN (2 of 2 to 3 nodes) can no longer be met once the second host is lost.
    below = start_elastic(
        hosts,
        [
            "data.dataset.num_points=2400",
            "trainer.max_steps=100000",
            "checkpoint.every_n_steps=5",
            *slow_steps(tmp_path / "below.slow"),
            "+launcher.rdzv_configs.join_timeout=10",
        ],
        tmp_path / "below",
        29520,
        nnodes="2:3",
        global_batch=60,
    )
    elastic["below"] = below
    try:
        with concurrent.futures.ThreadPoolExecutor(len(kinds) + 1) as pool:
            ended = pool.submit(lose_below_min, below, tmp_path / "below")
            faults = [
                pool.submit(lose_and_regain, elastic[k], tmp_path / k, times, tmp_path / f"{k}.slow")
                for k, (_, times) in kinds.items()
            ]
            straight = {
                k: run_dtf(
                    [*ELASTIC, *args, "launcher.nproc=2", f"data.global_batch_size={G}"],
                    tmp_path / f"{k}-straight",
                    expect=None,  # checked below, once the elastic runs have ended
                )
                for k, (args, _) in kinds.items()
            }
            for fault in faults:
                fault.result()
        codes = {k: [node.wait(timeout=300) for node in elastic[k]] for k in kinds}
        code, took = ended.result()
    finally:
        for nodes in elastic.values():
            for node in nodes:
                if node.proc is not None and node.proc.poll() is None:
                    node.kill()
    for kind, (_, times) in kinds.items():
        nodes, reference = elastic[kind], straight[kind]
        assert codes[kind] == [0, 0], nodes[0].output()[-3000:] + nodes[1].output()[-3000:]
        assert reference.returncode == 0, reference.stderr[-3000:]
        s = DtfRun(0, "", "", tmp_path / kind).summary
        changes = s["membership_changes"]
        if changes and changes[0]["old_world_size"] == 1:  # the first host began alone, and the second joined
            changes = changes[1:]
        assert [(c["old_world_size"], c["new_world_size"]) for c in changes] == [(2, 1), (1, 2)] * times, changes
        for c in changes:
            assert c["steps_recomputed"] is not None and c["steps_recomputed"] >= 0 and c["time_lost_s"] > 0, c
        assert all(c["steps_recomputed"] == 0 for c in changes[1::2]), changes  # a join: the old world saved first
        assert s["world_size"] == 2 and s["global_step"] == reference.summary["global_step"]
        assert max_difference(DtfRun(0, "", "", tmp_path / kind), reference) <= 1e-5
        run = s["global_step"]
        done = run + sum(c["steps_recomputed"] for c in changes)
        lost = sorted(c["time_lost_s"] for c in changes[0::2])
        # as torchft reports it: the share of the steps run that were kept
        print(f"{kind}: {run} of {done} steps kept ({run / done:.1%}); kill to first step on 1 rank: {lost} s")
    # No hang: the survivor waits join_timeout for a second node, then ends in one line; its newest
    # checkpoint is whole.
    from dtf.train.checkpoint import committed, verify

    last = below[0].output().strip().splitlines()[-1]
    newest = committed(tmp_path / "below" / "checkpoints")[0]
    step = _newest(tmp_path / "below")[0]
    assert code == 1 and took < 60, (code, took, below[0].output()[-3000:])
    assert last.startswith(
        f"dtf: error: fewer than 2 node(s) (launcher.nnodes=2:3) met at {hosts[0]}:29520 within 10 s "
        "(launcher.rdzv_configs.join_timeout): the run stopped, and its newest checkpoint, "
        f"step {step} ({newest}), is intact; "
    ), last
    assert verify(newest)[0]


class ElasticSlurmJob:
    """`python -m dtf <args> launcher=slurm` from the first host, slowed while `hold` exists; its
    driver's output in out."""

    def __init__(self, hosts: list[str], conf: str, args: list[str], hold: Path, tmp_path: Path) -> None:
        self.run_dir, self.out = tmp_path / "run", tmp_path / "job.out"
        args = [*TEST_DEFAULTS, *args, *slow_steps(hold), f"hydra.run.dir={self.run_dir}"]
        self.proc = start_command(on_first_host(hosts, conf, *dtf_command(*args)), self.out)

    def until(self, world: int, past: int) -> int:
        """Waits for a checkpoint of the given world size past a step; returns its step."""
        import time

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            step, size = _newest(self.run_dir)
            if size == world and step > past:
                return step
            time.sleep(0.2)
        raise AssertionError(f"no checkpoint of {world} rank(s) past step {past}: " + self.out.read_text()[-3000:])


def test_an_elastic_slurm_job_requeues_when_preempted_goes_on_when_a_node_dies_and_ends_as_the_uninterrupted_run(
    all_hosts: list[str], hosts: list[str], slurm_on_hosts: str, tmp_path: Path
) -> None:
    # launcher=slurm launcher.nodes=1:2, one rank per node. First what SLURM sends before a
    # preemption: the ranks save, the job is requeued and resumes on both nodes. Then the second
    # host dies (every process in its namespace, slurmd too: a machine that crashed) while the job
    # trains on both; the job keeps its first node (sbatch --no-kill), whose agent goes on alone from
    # the newest checkpoint. The second node's slurmd is started again at the end.
    import json
    import re
    import time

    hold = tmp_path / "slow"
    args = [
        *ELASTIC,
        "data.dataset.num_points=2400",
        "data.dataset.num_test=400",
        "trainer.max_steps=300",
        f"data.global_batch_size={G}",
    ]
    slurm = [
        *QUICK_RDZV,
        "checkpoint.every_n_steps=5",
        "launcher=slurm",
        "launcher.nodes=1:2",
        "launcher.tasks_per_node=1",
    ]
    job = ElasticSlurmJob(hosts, slurm_on_hosts, [*args, *slurm], hold, tmp_path)
    run_dir, out, until = job.run_dir, job.out, job.until

    try:
        until(2, 10)
        preempt(job.proc, out, lambda c: on_first_host(hosts, slurm_on_hosts, *c), time.monotonic() + 120)
        stopped = re.search(r"dtf: stopped at step (\d+); requeued SLURM job", out.read_text())
        assert stopped, out.read_text()
        until(2, int(stopped.group(1)) + 10)  # the requeued job trains on both nodes
        crashed = subprocess.run(["ip", "netns", "pids", hosts[1]], capture_output=True, text=True, check=True)
        subprocess.run(["kill", "-KILL", *crashed.stdout.split()], check=True)
        until(1, _newest(run_dir)[0] + 10)
        hold.unlink()
        straight = run_dtf([*args, "launcher.nproc=2"], tmp_path / "straight")
        job.proc.finish(0, timeout=240)
    finally:
        job.proc.stop()
        back_up(all_hosts, hosts[1:2], check=False)
    s = json.loads((run_dir / "summary.json").read_text())
    changes = s["membership_changes"]
    assert [(c["old_world_size"], c["new_world_size"]) for c in changes] == [(2, 1)], changes
    assert changes[0]["steps_recomputed"] >= 0 and changes[0]["time_lost_s"] > 0, changes
    assert s["launcher"] == "slurm" and s["slurm_restarts"] == 1 and s["world_size"] == 1
    assert s["global_step"] == straight.summary["global_step"]
    assert max_difference(DtfRun(0, "", "", run_dir), straight) <= 1e-5


def test_an_elastic_slurm_job_left_with_fewer_than_min_nodes_is_requeued_and_ends_as_the_uninterrupted_run(
    all_hosts: list[str], slurm_on_hosts: str, tmp_path: Path
) -> None:
    # launcher.nodes=2:3 on three nodes, one rank each, at a global batch that 2 and 3 ranks keep.
    # Two hosts die (every process of theirs, slurmd too) while the job trains: one node is left,
    # fewer than MIN. Its agent waits join_timeout for a second, then requeues the job
    # (launcher.requeue=true, the default); the hosts come back, and the requeued job starts on all
    # three and resumes from the newest checkpoint.
    import json
    import re
    import time

    if len(all_hosts) < 3:
        pytest.fail(f"needs 3 hosts, found {all_hosts}: run scripts/local-hosts.sh stop, and the test makes 3")
    hold = tmp_path / "slow"
    args = [
        *ELASTIC,
        "data.dataset.num_points=2400",
        "data.dataset.num_test=400",
        "trainer.max_steps=200",
        "data.global_batch_size=48",
    ]
    slurm = [
        *QUICK_RDZV,
        "+launcher.rdzv_configs.join_timeout=10",
        "checkpoint.every_n_steps=5",
        "launcher=slurm",
        "launcher.nodes=2:3",
        "launcher.tasks_per_node=1",
    ]
    job = ElasticSlurmJob(all_hosts, slurm_on_hosts, [*args, *slurm], hold, tmp_path)
    run_dir, out, until = job.run_dir, job.out, job.until

    def on_cluster(c: list[str]) -> list[str]:
        return on_first_host(all_hosts, slurm_on_hosts, *c)

    lost = all_hosts[1:]
    try:
        until(3, 10)
        for host in lost:
            crashed = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True, check=True)
            subprocess.run(["kill", "-KILL", *crashed.stdout.split()], check=True)
        deadline = time.monotonic() + 120
        while "requeued SLURM job" not in out.read_text() and time.monotonic() < deadline and job.proc.poll() is None:
            time.sleep(0.2)
        requeued = re.search(
            r"dtf: fewer than 2 node\(s\) met in 10 s; its newest checkpoint, step (\d+), is intact; "
            r"requeued SLURM job (\d+)",
            out.read_text(),
        )
        assert requeued, out.read_text()[-3000:]
        back_up(all_hosts, lost)
        # Pending again once every node of the job has answered that it ended there.
        start_requeued(requeued.group(2), on_cluster, timeout=240)
        until(3, int(requeued.group(1)) + 5)  # the requeued job trains on all three
        hold.unlink()
        straight = run_dtf([*args, "launcher.nproc=3"], tmp_path / "straight")
        job.proc.finish(0, timeout=240)
    finally:
        job.proc.stop()
        back_up(all_hosts, lost, check=False)  # the next tests need them (an error above is the one to see)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["slurm_restarts"] == 1 and s["world_size"] == 3 and s["membership_changes"] == [], s
    assert s["resumed_from_step"] == int(requeued.group(1)), s
    assert s["global_step"] == straight.summary["global_step"]
    assert max_difference(DtfRun(0, "", "", run_dir), straight) <= 1e-5


def back_up(all_hosts: list[str], nodes: list[str], check: bool = True) -> None:
    """Starts the slurmd of nodes whose host was killed again; the cluster keeps its jobs."""
    for node in nodes:
        started = run_script("local-slurm.sh", "start-node", slurm_hosts_env(all_hosts), timeout=180, args=[node])
        assert started.returncode == 0 or not check, started.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------
# Security (issue #49): a stranger on the nodes' network writes to the run's rendezvous store.
# ---------------------------------------------------------------------------------------------------


def test_a_stranger_who_rewrites_the_rendezvous_state_runs_nothing_and_the_run_refuses_it(
    all_hosts: list[str], tmp_path: Path
) -> None:
    # A 2-host run trains; from the third host, a stranger dials the rendezvous store (port 29500,
    # no credential) and rewrites the state under the key anyone can derive from the endpoint with
    # a pickle whose unpickling creates a file. Before dtf signed the state, both agents unpickled
    # it (the file appeared) and the run crashed. Now it is refused unread: the file never appears,
    # and each node ends in one line naming the key, exit status 1 (the run's state in the store
    # is gone: it cannot go on).
    import hashlib
    import os
    import re
    import stat
    import sys
    import time

    if len(all_hosts) < 3:
        pytest.fail(f"needs 3 hosts, found {all_hosts}: run scripts/local-hosts.sh stop, and the test makes 3")
    hosts, stranger = all_hosts[:2], all_hosts[2]
    run_dir, marker = tmp_path / "run", tmp_path / "stranger-was-here"
    endpoint = f"{hosts[0]}:29500"
    key = "torch.rendezvous.dtf-" + hashlib.sha256(endpoint.encode()).hexdigest()[:12]  # dtf's run id, torch's key
    long_run = ["launcher.nproc=1", "trainer.max_steps=100000", "data.dataset.num_points=20000"]
    common = [*TEST_DEFAULTS, *long_run, "launcher.nnodes=2", f"launcher.rdzv_endpoint={endpoint}"]
    with contextlib.ExitStack() as started:
        procs = [
            started.enter_context(
                start_command(
                    dtf_command(
                        *common, f"launcher.node_rank={node}", f"hydra.run.dir={run_dir}", prefix=[*LOCAL_HOSTS, host]
                    ),
                    tmp_path / f"{host}.out",
                    err=tmp_path / f"{host}.err",
                )
            )
            for node, host in enumerate(hosts)
        ]
        deadline = time.monotonic() + 120
        while not (run_dir / "logs" / "nodes.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        attack = [*LOCAL_HOSTS, stranger, sys.executable, str(HELPERS / "store_stranger.py")]
        wrote = run_command([*attack, hosts[0], "29500", key, str(marker)], timeout=60)
        assert f"stranger: wrote {key}" in wrote.stdout, wrote.stdout
        for proc in procs:
            proc.finish(1, timeout=60)
    assert not marker.exists(), "the stranger's pickle was unpickled on a node"
    for proc in procs:
        last = proc.error_output().strip().splitlines()[-1]
        assert re.match(
            rf"dtf: error: the rendezvous store holds under {key} a value that no node of this run wrote .* at "
            rf"{endpoint}, .*: it was refused unread, nothing of it ran, and the run stopped",
            last,
        ), last
    secret = run_dir / ".dtf-rendezvous.key"  # shared by the nodes, readable by the user alone
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.stat().st_uid == os.getuid()
