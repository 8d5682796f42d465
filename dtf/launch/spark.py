"""Ranks as the tasks of one Spark barrier stage (the way HorovodRunner and Maggy ran them).

The driver starts (or joins) a SparkSession on launcher.master, and runs an RDD of nproc
partitions in barrier mode: Spark schedules all tasks at once or none, and when one fails it
kills the others, so a failed rank never leaves the rest waiting in a collective. Each task is
one rank: rank = partition id; rank 0's host and a free port it picks (shared with allGather)
are the rendezvous. Each rank writes its output to <run_dir>/logs/spark/rank_<r>.log (the run
dir must be on storage the executors share); the driver streams rank 0's log and returns its result.
A rank that fails records why (dtf.failures) before Spark stops the stage; the driver blames the
rank that failed first, not the peer whose error Spark happens to report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from dtf import failures
from dtf.config.schema import SparkLauncherConfig
from dtf.config.typed import RunConfig
from dtf.errors import RankFailedError, UserError
from dtf.launch.base import Launcher, LogTail, WorkerFn, rank_result
from dtf.machine import require_java
from dtf.results import RunResult

LOG_DIR = "logs/spark"
DEFAULT_MASTER = "local[2]"  # launcher.master unset and no active SparkSession
_LOG4J = Path(__file__).with_name("spark_conf") / "log4j2.properties"


def _log_path(run_dir: str, rank: int) -> Path:
    return Path(run_dir) / LOG_DIR / f"rank_{rank}.log"


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """fd-level redirect (torch and gloo print from C++ too), undone after: Spark reuses workers."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a", buffering=1) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_barrier_task(fn: WorkerFn, run: RunConfig, run_dir: str, _: Iterator[Any]) -> Iterator[Any]:
    """One barrier task = one rank."""
    from pyspark import BarrierTaskContext

    from dtf.dist.env import free_port

    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
    port = ctx.allGather(str(free_port()) if rank == 0 else "")[0]
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(len(hosts)),
        LOCAL_RANK=str(hosts[:rank].count(hosts[rank])),
        LOCAL_WORLD_SIZE=str(hosts.count(hosts[rank])),
        MASTER_ADDR=hosts[0],
        MASTER_PORT=port,
    )
    if len(set(hosts)) > 1:  # gloo/NCCL on the interface that reaches rank 0's host
        for key, value in _interface_env(hosts[0]).items():
            os.environ.setdefault(key, value)
    with _output_to(_log_path(run_dir, rank)):
        result = fn(run, run_dir)  # a failure is recorded (dtf.failures) and fails the task, so Spark ends the stage
    if rank == 0:
        yield result


def _interface_env(rank0_host: str) -> dict[str, str]:
    from dtf.launch.nodes import interface_address, route_source

    address = route_source(socket.gethostbyname(rank0_host), 9)
    names = [name for _, name in socket.if_nameindex() if interface_address(name) == address]
    return {key: names[0] for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")} if names else {}


def _check_master_reachable(master: str) -> None:
    if not master.startswith("spark://"):
        return  # local[N], local-cluster[...], yarn, k8s://...: Spark itself reports those
    for hostport in master.removeprefix("spark://").split(","):
        url = urlparse(f"spark://{hostport}")
        try:
            with socket.create_connection((url.hostname or "", url.port or 7077), timeout=5):
                return
        except OSError:
            continue
    raise UserError(
        f"launcher.master={master}: no Spark master answers there; start one "
        "(scripts/local-spark.sh start prints a URL) or fix the URL"
    )


class SparkLauncher(Launcher):
    cfg: SparkLauncherConfig

    def launch(self, fn: WorkerFn, run: RunConfig, run_dir: str) -> RunResult:
        c = self.cfg
        require_java("launcher=spark")
        spark = _active_session(c.master)
        if spark is None:
            _check_master_reachable(c.master or DEFAULT_MASTER)
            spark = self._session(run_dir, c.master or DEFAULT_MASTER)
        failures.clear(run_dir)
        wait_for_task_slots(spark.sparkContext, c.nproc)
        rdd = spark.sparkContext.parallelize(range(c.nproc), c.nproc).barrier()
        stop_tail = threading.Event()
        # Rank 0's log streams to the driver's terminal while the stage runs.
        tail = threading.Thread(target=LogTail(_log_path(run_dir, 0)).follow, args=(stop_tail,), daemon=True)
        tail.start()
        try:
            results = rdd.mapPartitions(lambda it: run_barrier_task(fn, run, run_dir, it)).collect()
        except Exception as e:  # py4j's Java error, holding the failed rank's Python traceback
            raise _failure(e, run_dir) from None
        finally:
            stop_tail.set()
            tail.join()
        return rank_result(results[0] if results else None)

    def _session(self, run_dir: str, master: str) -> Any:
        from pyspark.sql import SparkSession

        c = self.cfg
        # PySpark starts Python workers with $PYSPARK_PYTHON: this interpreter, with dtf and torch.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        logging.getLogger("py4j").setLevel(logging.WARNING)
        driver_log = Path(run_dir) / LOG_DIR / "driver.log"
        driver_log.parent.mkdir(parents=True, exist_ok=True)
        java_options = f"-Dlog4j2.configurationFile={_LOG4J} -Ddtf.spark.log={driver_log}"
        local = master.startswith("local") or "127.0.0.1" in master or "localhost" in master
        paths = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        conf: dict[str, str] = {
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            # A rank that fails fails the run: no retry of the whole stage by Spark.
            "spark.task.maxFailures": "1",
            "spark.stage.maxConsecutiveAttempts": "1",
            # More ranks than free task slots: fail in seconds, not after ~10 minutes of checks ...
            "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "2s",
            "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "3",
            # ... counted once the application's executors have registered (each is a JVM that takes
            # seconds to start), not while they are still starting.
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "60s",
            "spark.pyspark.python": sys.executable,
            "spark.driver.extraJavaOptions": f"{java_options} {c.spark_conf.get('spark.driver.extraJavaOptions', '')}",
            # The user's modules (model/data _target_s) import on the executors as on the driver.
            "spark.executorEnv.PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "spark.executorEnv.OMP_NUM_THREADS": "1",
            **_driver_address(master, local),
            **{str(k): str(v) for k, v in c.spark_conf.items() if k != "spark.driver.extraJavaOptions"},
        }
        builder = SparkSession.builder.master(master).appName(c.app_name)
        for key, value in conf.items():
            builder = builder.config(key, value)
        return builder.getOrCreate()


def wait_for_task_slots(sc: Any, nproc: int) -> None:
    """A barrier stage needs a task slot for every rank at once, and a new application's executors
    take seconds to register (each is a JVM its worker starts for it): right after a cluster or a
    session starts there are fewer slots than there will be. Wait for nproc of them, as long as
    spark.scheduler.maxRegisteredResourcesWaitingTime says (dtf's default: 60 s), and only then
    refuse, saying how many there were."""
    waiting_s = float(
        sc._jvm.org.apache.spark.network.util.JavaUtils.timeStringAsSec(
            sc.getConf().get("spark.scheduler.maxRegisteredResourcesWaitingTime", "30s")
        )
    )
    deadline = time.monotonic() + waiting_s
    slots = _task_slots(sc)
    while slots < nproc and time.monotonic() < deadline:
        time.sleep(0.5)
        slots = _task_slots(sc)
    if slots < nproc:
        raise UserError(
            f"launcher.nproc={nproc} is more than the Spark cluster's task slots: it had {slots} after waiting "
            f"{waiting_s:g} s for executors to register (spark.scheduler.maxRegisteredResourcesWaitingTime); a barrier "
            "stage needs one for every rank at once: lower launcher.nproc or add executors/cores"
        )


def _task_slots(sc: Any) -> int:
    """The tasks the registered executors can run at once: what Spark's own barrier check counts
    (SparkContext.maxNumConcurrentTasks, for the default resource profile)."""
    context = sc._jsc.sc()
    return int(context.maxNumConcurrentTasks(context.resourceProfileManager().defaultResourceProfile()))


def _driver_address(master: str, local: bool) -> dict[str, str]:
    """Where the executors reach this driver: 127.0.0.1 for a local cluster; for a standalone
    master elsewhere, this machine's address on the route to it (its host name may resolve to
    127.0.1.1, or to another network); YARN and Kubernetes: Spark's own choice."""
    if local:
        return {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
    if not master.startswith("spark://"):
        return {}
    from dtf.launch.nodes import route_source

    url = urlparse(master.split(",")[0])
    try:
        address = route_source(socket.gethostbyname(url.hostname or ""), url.port or 7077)
    except OSError:
        return {}
    return {"spark.driver.host": address, "spark.driver.bindAddress": address}


def _active_session(master: str | None) -> Any | None:
    """The SparkSession this process already has (a notebook's), if any. Spark allows one
    SparkContext per process, and asking for another master returns that one regardless: a
    launcher.master that names another cluster is refused instead of silently ignored."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is None:
        return None
    running = active.sparkContext.master
    if master is not None and master != running:
        raise UserError(
            f"launcher.master={master}, but this process already has a SparkSession on {running} (Spark allows "
            "one per process): leave launcher.master unset to run on it, or stop it first (spark.stop())"
        )
    return active


def _failure(e: Exception, run_dir: str) -> UserError:
    first = failures.blamed(run_dir)
    if first is not None:
        return failures.report(first, str(_log_path(run_dir, first.rank)))
    text = str(e)
    if "requires more slots than the total number of slots" in text or "SPARK-24819" in text:
        return UserError(
            "launcher.nproc is more than the Spark cluster's free task slots (a barrier stage needs them all "
            "at once): lower launcher.nproc or add executors/cores"
        )
    # "barrier task ResultTask(<stage>, <partition>)" or "task <partition>.<attempt> in stage ..."
    task = re.search(r"ResultTask\(\d+, (\d+)\)", text) or re.search(r"[Tt]ask (\d+)(?:\.\d+)? in stage", text)
    errors = re.findall(r"^(\w[\w.]*(?:Error|Exception): .*)$", text, flags=re.MULTILINE)
    python_errors = [line for line in errors if not line.startswith(("org.", "java.", "py4j."))]
    reason = python_errors[-1] if python_errors else (errors[0] if errors else type(e).__name__)
    if task is None:
        return RankFailedError(f"Spark job failed: {reason}")
    rank = int(task.group(1))
    return RankFailedError(f"rank {rank} failed: {reason} (its log: {_log_path(run_dir, rank)})")
