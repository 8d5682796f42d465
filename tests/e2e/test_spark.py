"""launcher=spark against a real standalone Spark cluster (scripts/local-spark.sh)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtf.dist.env import free_port
from tests.conftest import SHORT_RUN
from tests.helpers.clusters import script_cluster
from tests.helpers.run_command import TEST_DEFAULTS, DtfRun, dtf_command, dtf_env, run_command, run_dtf, start_command

SHORT = SHORT_RUN


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    with script_cluster("local-spark.sh", "SPARK_MASTER_URL") as url:
        yield url


def test_ranks_as_spark_barrier_tasks_give_the_local_result(
    tmp_path: Path, master: str, short_local_run: DtfRun
) -> None:
    local = short_local_run
    spark = run_dtf([*SHORT, "launcher=spark", f"launcher.master={master}"], tmp_path / "spark")
    s = spark.summary
    assert s["launcher"] == "spark" and s["world_size"] == 2
    assert s["params_sha256"] == local.summary["params_sha256"]
    assert s["train_loss_per_epoch"] == local.summary["train_loss_per_epoch"]
    # rank 0's output reached the driver; every rank's is in the run dir
    assert "dtf: final train loss" in spark.stdout
    logs = tmp_path / "spark" / "logs" / "spark"
    assert "epoch 2" in (logs / "rank_0.log").read_text() and (logs / "rank_1.log").is_file()


def test_a_users_module_on_a_relative_pythonpath_imports_on_the_executors(tmp_path: Path, master: str) -> None:
    # PYTHONPATH=userland works where the driver runs; the executors run elsewhere (their work dir)
    import shutil

    pkg = tmp_path / "userland" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    shutil.copy(Path(__file__).parents[1] / "helpers" / "wide.py", pkg / "nets.py")
    run = run_dtf(
        [*SHORT, "launcher=spark", f"launcher.master={master}", "model._target_=mypkg.nets.Wide"],
        tmp_path / "run",
        extra_pythonpath=[Path("userland")],  # relative to the driver's working directory
    )
    assert run.summary["launcher"] == "spark" and run.summary["world_size"] == 2


# Bad input raised inside a Spark task: its message and exit status 2 cross the executor boundary (a
# rank's RuntimeError, exit 1, is tested on the local launcher and in a SLURM allocation); a hung
# rank is named, not the peer whose collective timed out waiting for it.
@pytest.mark.parametrize(
    ("how", "code", "said"),
    [
        ("user_error", 2, "model.fail_rank=1: injected bad input; fix model.fail_rank (rank 1)"),
        # rank 1 hangs in its forward; rank 0's collective times out first, but rank 1 is named
        (
            "hang",
            1,
            "rank 1 failed: made no progress in forward of step 3 while rank(s) 0 waited for it, until the collective "
            "timeout (trainer.dist_timeout_s: 10 s) ended the run (rank 0: RuntimeError: ",
        ),
    ],
)
def test_a_rank_that_raises_fails_the_run_with_its_error(
    tmp_path: Path, master: str, how: str, code: int, said: str
) -> None:
    t0 = time.monotonic()
    run = run_dtf(
        [
            *SHORT,
            "launcher=spark",
            f"launcher.master={master}",
            "model._target_=user_models.FailingModel",
            f"+model.how={how}",
            *(["trainer.dist_timeout_s=10"] if how == "hang" else []),
        ],
        tmp_path / "run",
        expect=code,
    )
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith(f"dtf: error: {said}"), run.stderr
    # the rank that failed first is named, not the peer Spark reports; as on every launcher, its
    # traceback is shown unless the error is the user's (one line, then)
    assert run.stderr.count("Traceback (most recent call last)") == (1 if how == "raise" else 0), run.stderr
    assert time.monotonic() - t0 < 120  # rank 0 was stopped, not left waiting


def test_an_unreachable_master_is_one_line(dtf) -> None:  # type: ignore[no-untyped-def]
    run = dtf("launcher=spark", "launcher.master=spark://127.0.0.1:9", expect=2)
    assert run.stderr.strip().splitlines() == [
        "dtf: error: launcher.master=spark://127.0.0.1:9: no Spark master answers there; start one "
        "(scripts/local-spark.sh start prints a URL) or fix the URL"
    ]


# How long a run waits for executors to register (dtf's default: 60 s), shorter for a test.
WAITING = "+launcher.spark_conf={spark.scheduler.maxRegisteredResourcesWaitingTime: 8s}"


def test_more_ranks_than_task_slots_is_one_line_not_a_hang(tmp_path: Path, master: str) -> None:
    import re

    run = run_dtf(
        ["launcher=spark", f"launcher.master={master}", "launcher.nproc=3", WAITING], tmp_path / "run", expect=2
    )
    assert re.fullmatch(  # 2 once both executors have registered (on a busy machine, maybe not yet)
        r"dtf: error: launcher\.nproc=3 is more than the Spark cluster's task slots: it had [012] after waiting 8 s "
        r"for executors to register \(spark\.scheduler\.maxRegisteredResourcesWaitingTime\); a barrier stage needs "
        r"one for every rank at once: lower launcher\.nproc or add executors/cores",
        run.stderr.strip().splitlines()[-1],
    ), run.stderr[-2000:]


def test_a_run_started_before_the_clusters_workers_waits_for_their_executors(tmp_path: Path) -> None:
    # A master alone, as right after a cluster's (re)start: the run's application registers, and a
    # worker with 2 cores comes 10 s later (Spark's own barrier check gives up after 6 s).
    import os
    import signal

    spark_home = Path(
        subprocess.run(
            [sys.executable, "-c", "import os, pyspark; print(os.path.dirname(pyspark.__file__))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    url = f"spark://127.0.0.1:{free_port('127.0.0.1')}"
    env = {**dtf_env(), "SPARK_HOME": str(spark_home), "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    daemons = []

    def start(*args: str) -> None:
        log = open(tmp_path / f"{args[0].rsplit('.', 1)[-1]}.log", "w")  # noqa: SIM115 (the daemon keeps it)
        daemons.append(
            subprocess.Popen(
                [str(spark_home / "bin" / "spark-class"), *args],
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        )

    try:
        port = url.rsplit(":", 1)[1]
        start("org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", port, "--webui-port", "0")
        deadline = time.monotonic() + 60
        while "I have been elected leader" not in (tmp_path / "Master.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        args = [*TEST_DEFAULTS, *SHORT, "launcher=spark", f"launcher.master={url}", f"hydra.run.dir={tmp_path / 'run'}"]
        with start_command(dtf_command(*args), tmp_path / "run.log") as run:
            deadline = time.monotonic() + 120  # the run's application has registered with the master ...
            while "Registering app" not in (tmp_path / "Master.log").read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(10)  # ... and waited longer than Spark's own barrier check does (3 times 2 s)
            (tmp_path / "work").mkdir()
            worker = ["--host", "127.0.0.1", "--cores", "2", "--memory", "2g", "--webui-port", "0"]
            start("org.apache.spark.deploy.worker.Worker", *worker, "--work-dir", str(tmp_path / "work"), url)
            run.finish(0, timeout=300)
    finally:
        for daemon in daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGTERM)
            daemon.wait(timeout=60)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2


@pytest.mark.parametrize(
    "command",
    [["dtf", "launcher=spark", "trainer.max_steps=2"], ["dtf.data.prepare", "digits", "--format", "petastorm"]],
)
def test_without_java_spark_is_refused_in_one_line_naming_it(tmp_path: Path, command: list[str]) -> None:
    no_java = {"JAVA_HOME": None, "PATH": str(tmp_path)}  # no java anywhere on PATH
    proc = run_command(dtf_command(*command[1:], module=command[0]), expect=2, timeout=120, cwd=tmp_path, env=no_java)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dtf: error:") and "Java" in lines[0], proc.stderr[-2000:]


def test_a_dtf_sweeps_trial_runs_as_a_spark_stage_and_reports_from_an_executor(tmp_path: Path, master: str) -> None:
    """hydra/sweeper=dtf with launcher=spark: the trial's rank 0, a barrier task on an executor,
    reports each evaluation to the study's journal file in the sweep dir."""
    import json

    import optuna

    from dtf.sweep.study import open_storage

    sweep_dir = tmp_path / "sweep"
    args = [
        *SHORT,
        "trainer.max_steps=null",
        "trainer.max_epochs=2",
        "launcher=spark",
        f"launcher.master={master}",
        "hydra/sweeper=dtf",
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.pruner=median",
        "optimizer.lr=tag(log,interval(1e-4,1e-2))",
    ]
    run = run_dtf(args, sweep_dir, multirun=True, timeout=400)
    assert "1 completed" in run.stdout, run.stdout
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["launcher"] == "spark" and summary["pruned"] is False
    study = optuna.load_study(study_name="dtf", storage=open_storage(str(sweep_dir / "optuna.journal")))
    (trial,) = study.trials
    # epoch 1 reported from the executor (the last epoch is the trial's value, not a report)
    assert trial.intermediate_values == {1: summary["metrics_per_epoch"][0]["test/loss"]}
    assert trial.value == summary["objective"]


def test_a_notebooks_own_spark_session_runs_the_ranks(tmp_path: Path, master: str) -> None:
    # The notebook makes its SparkSession on the cluster; dtf.run_function(..., launcher=spark) with
    # no launcher.master runs the ranks on it, and rank 0's output streams into the cell.
    from tests.e2e.test_notebooks import check_maggy_notebook
    from tests.helpers.notebooks import execute

    printed = execute("maggy_approximator.ipynb", tmp_path, {"DTF_SPARK_MASTER": master, "DTF_EPOCHS": "3"})
    assert f"on {master}" in printed[0], printed[0][-2000:]
    summary = check_maggy_notebook(printed, 2)
    assert summary["launcher"] == "spark"


def test_the_horovodrunner_notebook_runs_its_ranks_on_the_notebooks_spark_session(tmp_path: Path, master: str) -> None:
    # Databricks' notebook with `from sparkdl import HorovodRunner` changed: HorovodRunner(np=2)
    from tests.e2e.test_notebooks import check_horovod_notebook
    from tests.helpers.notebooks import execute

    printed = execute(
        "horovod_mnist.ipynb", tmp_path, {"DTF_SPARK_MASTER": master, "DTF_HVD_NP": "2", "DTF_EPOCHS": "2"}
    )
    assert f"on {master}" in printed[0], printed[0][-2000:]
    assert check_horovod_notebook(printed, 2, tmp_path)["launcher"] == "spark"


def test_a_master_other_than_the_active_sessions_is_one_error(tmp_path: Path) -> None:
    # Spark keeps one session per process and would silently run on it: say so instead.
    body = (
        "import os, sys, dtf\n"
        "os.environ['PYSPARK_PYTHON'] = sys.executable\n"
        "from pyspark.sql import SparkSession\n"
        "SparkSession.builder.master('local[1]').config('spark.ui.enabled', 'false').getOrCreate()\n"
        "try:\n"
        "    dtf.run(['launcher=spark', 'launcher.master=\"local[2]\"'], run_dir='r')\n"
        "except dtf.UserError as e:\n"
        "    print('UserError:', e)\n"
    )
    done = run_command([sys.executable, "-c", body], cwd=tmp_path, timeout=300)
    assert (
        "UserError: launcher.master=local[2], but this process already has a SparkSession on local[1]" in done.stdout
    ), done.stdout
