"""launcher=slurm against a real one-node SLURM cluster (scripts/local-slurm.sh)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from dtf.sweep.study import open_storage
from tests.conftest import SHORT_RUN
from tests.helpers.clusters import run_script, script_cluster
from tests.helpers.run_command import DtfRun, run_dtf

SHORT = SHORT_RUN


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster() -> Iterator[str]:
    with script_cluster("local-slurm.sh", "SLURM_CONF") as conf, pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", conf)
        yield conf


def _job_id(run: DtfRun) -> str:
    found = re.search(r"dtf: submitted SLURM job (\d+)", run.stdout)
    assert found, run.stdout
    return found.group(1)


# The strategy is the ranks' business, not the launcher's: DDP here (every strategy equals DDP on
# local ranks, tests/dist/test_strategies.py).
def test_a_slurm_run_really_runs_under_slurm_and_equals_the_local_run(tmp_path: Path, short_local_run: DtfRun) -> None:
    local = short_local_run
    slurm = run_dtf([*SHORT, "launcher=slurm"], tmp_path / "slurm")
    job = _job_id(slurm)
    s = slurm.summary
    assert s["slurm_job_id"] == job and s["launcher"] == "slurm" and s["world_size"] == 2
    # the job is SLURM's, with two tasks: scontrol knows it (finished jobs stay listed for MinJobAge)
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=True).stdout
    assert f"JobId={job} " in shown and "NumTasks=2" in shown and "JobState=FAILED" not in shown
    assert s["params_sha256"] == local.summary["params_sha256"]
    assert s["train_loss_per_epoch"] == local.summary["train_loss_per_epoch"]
    # rank 0 streamed to the terminal; every rank's log is in the run dir
    assert "dtf: final train loss" in slurm.stdout
    assert sorted(p.name for p in (tmp_path / "slurm" / "slurm").glob("*_log.out")) == [
        f"{job}_0_log.out",
        f"{job}_1_log.out",
    ]


def test_not_waiting_says_where_the_result_will_land_and_how_to_follow_the_job(tmp_path: Path) -> None:
    run = run_dtf([*SHORT, "launcher=slurm", "launcher.wait=false"], tmp_path / "run")
    job = _job_id(run)
    summary = tmp_path / "run" / "summary.json"
    said = run.stdout.strip().splitlines()[-1]
    assert f"squeue -j {job}" in said and str(summary) in said and f"{job}_0_log.out" in said, run.stdout
    deadline = time.monotonic() + 180  # the job goes on without the driver, and lands where it said
    while not summary.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert json.loads(summary.read_text())["slurm_job_id"] == job


# A preempted job (SIGTERM before the time limit, scontrol requeue) that checkpoints, is requeued and
# ends as the uninterrupted run: tests/e2e/test_multinode.py's, on two nodes.


def test_a_sweep_submits_one_job_per_point_and_collects_them(tmp_path: Path) -> None:
    sweep = run_dtf(
        [*SHORT, "launcher=slurm", "launcher.tasks_per_node=1", "optimizer.lr=0.001,0.002"],
        tmp_path / "sweep",
        multirun=True,
    )
    jobs = re.findall(r"submitted SLURM job (\d+)", sweep.stdout)
    assert len(set(jobs)) == 2
    # both were submitted before either was waited for: they could run side by side
    assert sweep.stdout.index(f"job {jobs[1]};") < sweep.stdout.index(f"SLURM job {jobs[0]} done")
    summaries = [json.loads((tmp_path / "sweep" / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [s["slurm_job_id"] for s in summaries] == jobs
    assert summaries[0]["final_train_loss"] != summaries[1]["final_train_loss"]


def test_no_slurm_on_the_machine_is_one_line(dtf) -> None:  # type: ignore[no-untyped-def]
    env_path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not Path(p, "sbatch").exists())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", env_path)
        run = dtf("launcher=slurm", expect=2)
    assert run.stderr.strip().splitlines() == [
        "dtf: error: launcher=slurm: sbatch is not on PATH: run on a machine with SLURM's client tools "
        "(scripts/local-slurm.sh start sets up one here), or use launcher=local"
    ]


@pytest.mark.parametrize("nodes", ["1", "1:2"])  # an elastic job asks each node for one task with every rank's CPUs
def test_more_tasks_than_the_cluster_has_is_one_line_not_a_hang(dtf, nodes: str) -> None:  # type: ignore[no-untyped-def]
    run = dtf("launcher=slurm", "launcher.tasks_per_node=64", f"launcher.nodes={nodes}", timeout=120, expect=2)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "can never start" in lines[0] and "launcher.tasks_per_node" in lines[0]
    asked = "2 node(s)" if nodes == "1:2" else "1 node(s)"
    assert f"cannot give {asked} x 64 task(s) x 1 CPU(s);" in lines[0]
    job = _job_id(run)
    state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()
    assert state in ("", "CANCELLED")  # dtf cancelled its job instead of leaving it pending forever


def test_inside_an_allocation_the_ranks_start_in_place_with_srun(tmp_path: Path, short_local_run: DtfRun) -> None:
    local = short_local_run
    # salloc runs dtf inside a fresh allocation: dtf starts the ranks with srun instead of submitting
    run = run_dtf([*SHORT, "launcher=slurm"], tmp_path / "alloc", prefix=["salloc", "-n", "2"])
    assert "submitted SLURM job" not in run.stdout
    s = run.summary
    assert s["slurm_job_id"] and s["world_size"] == 2
    assert s["params_sha256"] == local.summary["params_sha256"]


def test_as_the_tasks_of_a_users_own_srun_each_process_is_a_rank(tmp_path: Path, short_local_run: DtfRun) -> None:
    # srun starts `python -m dtf` twice: each task is one rank, in place; rank 0 reports, rank 1 just ends
    run = run_dtf([*SHORT, "launcher=slurm"], tmp_path / "srun", prefix=["salloc", "-n", "2", "srun"])
    assert run.summary["world_size"] == 2 and run.summary["params_sha256"] == short_local_run.summary["params_sha256"]
    assert run.stdout.count("dtf: final train loss") == 1


def test_a_sweep_inside_an_allocation_runs_each_point_once_in_its_own_run_dir(tmp_path: Path) -> None:
    # the driver resolves each point's config; srun's tasks load it, they never re-parse the sweep's argv
    sweep_dir = tmp_path / "sweep"
    run = run_dtf(
        [*SHORT, "launcher=slurm", "optimizer.lr=1e-3,2e-3"],
        sweep_dir,
        multirun=True,
        prefix=["salloc", "-n", "2"],
    )
    assert "submitted SLURM job" not in run.stdout
    assert run.stdout.count("dtf: final train loss") == 2, run.stdout  # one line per run, from its rank 0
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no run dirs elsewhere
    summaries = [json.loads((sweep_dir / point / "summary.json").read_text()) for point in ("0", "1")]
    for point, lr, s in zip(("0", "1"), (1e-3, 2e-3), summaries, strict=True):
        assert s["run_dir"] == str(sweep_dir / point)
        assert f"optimizer.lr={lr:g}" in (sweep_dir / point / ".hydra" / "overrides.yaml").read_text()
        assert s["world_size"] == 2 and s["lr_final"] == pytest.approx(lr * 2)  # linear LR scaling by 2 ranks
    assert summaries[0]["slurm_job_id"] == summaries[1]["slurm_job_id"]  # both in the one allocation


# Each way of running under SLURM with one of the two kinds of failure (the local and Spark tests
# have both kinds): a job dtf submits, and ranks srun starts inside an allocation.
@pytest.mark.parametrize(
    ("where", "how", "code", "said"),
    [
        ("submitted", "user_error", 2, "model.fail_rank=1: injected bad input; fix model.fail_rank (rank 1)"),
        ("in an allocation", "raise", 1, "rank 1 failed: RuntimeError: injected failure on rank 1"),
        # rank 1 hangs in its forward; rank 0's collective times out first, but rank 1 is named
        (
            "submitted",
            "hang",
            1,
            "rank 1 failed: made no progress in forward of step 3 while rank(s) 0 waited for it, until the collective "
            "timeout (trainer.dist_timeout_s: 10 s) ended the run (rank 0: RuntimeError: ",
        ),
    ],
)
def test_a_rank_failing_under_slurm_is_named_in_one_line(
    tmp_path: Path, where: str, how: str, code: int, said: str
) -> None:
    args = ["model._target_=user_models.FailingModel", "+model.fail_rank=1", f"+model.how={how}", "launcher=slurm"]
    args += ["trainer.dist_timeout_s=10"] if how == "hang" else []
    prefix = ["salloc", "-n", "2"] if where == "in an allocation" else []
    t0 = time.monotonic()
    run = run_dtf([*SHORT, *args], tmp_path / "run", prefix=prefix, expect=code)
    errors = [line for line in run.stderr.splitlines() if line.startswith("dtf: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"dtf: error: {said}"), run.stderr[-3000:]
    assert run.stderr.count("Traceback (most recent call last)") == (1 if how == "raise" else 0), run.stderr
    assert time.monotonic() - t0 < 120  # the other task was ended, not left waiting in a collective


# A model whose rank process takes seconds to exit after its result is written (as a process
# with slow teardown does): the job is still RUNNING or COMPLETING while its result files exist.
SLOW_EXIT_MODEL = """
import atexit
import time

from user_models import FailingModel


class SlowExitModel(FailingModel):
    def __init__(self, exit_delay_s: float = 0.0, **kwargs: object) -> None:
        super().__init__(**kwargs)
        atexit.register(time.sleep, exit_delay_s)
"""


def test_waiting_for_a_job_returns_once_it_has_left_the_queue(tmp_path: Path) -> None:
    (tmp_path / "slow_exit.py").write_text(SLOW_EXIT_MODEL)
    args = ["model._target_=slow_exit.SlowExitModel", "+model.fail_rank=-1", "+model.exit_delay_s=3"]
    run = run_dtf(
        [*SHORT, *args, "launcher=slurm", "launcher.tasks_per_node=1"],
        tmp_path / "run",
        extra_pythonpath=[tmp_path],
    )
    job = _job_id(run)
    # right after dtf returned: the job has ended (not RUNNING, not COMPLETING with steps still cleaning up)
    state = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"], capture_output=True, text=True
    ).stdout.strip()
    assert state == "COMPLETED", f"job {job} is {state} after dtf returned"


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (slurmctld's and slurmd's)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def _proc_stat(pid: int) -> tuple[str, int, str] | None:
    """(state, ppid, start time) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), fields[19]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _job_processes(job: str, conf: str) -> dict[int, str]:
    """pid -> start time of the processes of one job of the cluster with this SLURM_CONF: the batch
    script, sruns and tasks (known by their environment) and the slurmstepd above them."""
    found: dict[int, str] = {}
    marks = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_CONF={conf}".encode()}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        stat = _proc_stat(int(proc.name))
        if stat is None or not marks <= environ:
            continue
        found[int(proc.name)] = stat[2]
        parent = _proc_stat(stat[1])
        if parent and _comm(stat[1]) == "slurmstepd":
            found[stat[1]] = parent[2]
    return found


def _still_running(processes: dict[int, str]) -> list[str]:
    """Those that still run (not gone, not a zombie, not a new process with a reused pid), described."""
    alive = []
    for pid, started in processes.items():
        stat = _proc_stat(pid)
        if stat is not None and stat[0] != "Z" and stat[2] == started:
            alive.append(f"{pid} {_comm(pid)}")
    return alive


def test_stop_cancels_and_reaps_running_jobs_and_start_begins_clean() -> None:
    # A cluster of its own (own state dir, own ports): stopping it disturbs no one else's jobs.
    # A short path: slurmstepd's sockets live in the spool dir, and socket paths are short.
    cluster_dir = tempfile.mkdtemp(prefix="dtf-slurm-")
    try:
        _stop_start_with_a_running_job({"DTF_SLURM_DIR": cluster_dir, "DTF_SLURM_PORT": str(_free_port_pair())})
    finally:
        shutil.rmtree(cluster_dir, ignore_errors=True)


def _stop_start_with_a_running_job(env: dict[str, str]) -> None:
    old_job: dict[int, str] = {}
    with script_cluster("local-slurm.sh", "SLURM_CONF", env) as conf:
        slurm_env = {**os.environ, "SLURM_CONF": conf}

        def slurm(*cmd: str) -> str:
            return subprocess.run(cmd, capture_output=True, text=True, env=slurm_env, timeout=60).stdout.strip()

        try:
            # a job with a running step: slurmstepd for the batch script and for the step, srun, two tasks
            job = slurm("sbatch", "--parsable", "-n", "2", "--output=/dev/null", "--wrap", "srun sleep 600")
            assert job.isdigit(), job
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                old_job = _job_processes(job, conf)
                names = [_comm(pid) for pid in old_job]
                if names.count("slurmstepd") == 2 and names.count("sleep") == 2 and "srun" in names:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"job {job} did not start its step: {slurm('squeue', '-j', job)}")

            stopped = run_script("local-slurm.sh", "stop", env, timeout=120)
            assert stopped.returncode == 0, stopped.stderr
            problems = []
            survivors = _still_running(old_job)
            if survivors:
                problems.append(f"after stop, processes of job {job} still run: {survivors}")
            up = False
            try:
                restarted = run_script("local-slurm.sh", "start", env, timeout=60)
                up = restarted.returncode == 0
                if not up:
                    problems.append(f"start failed: {restarted.stderr[-1000:]}")
            except subprocess.TimeoutExpired:
                problems.append("start did not bring the cluster up within 60 s")
            if up:
                queue = slurm("squeue", "-h", "-t", "all", "-o", "%i %T")
                if queue:
                    problems.append(f"after start, the queue holds jobs of the earlier cluster: {queue!r}")
                # a new job gets the node: it starts and ends, instead of pending behind the old one
                new_job = slurm("sbatch", "--parsable", "-n", "2", "--output=/dev/null", "--wrap", "srun true")
                deadline = time.monotonic() + 30
                state = ""
                while time.monotonic() < deadline:
                    state = slurm("squeue", "-h", "-t", "all", "-j", new_job, "-o", "%T %r")
                    if state.split()[:1] in (["COMPLETED"], ["FAILED"], ["CANCELLED"]):
                        break
                    time.sleep(0.2)
                if not state.startswith("COMPLETED"):
                    problems.append(f"a new job did not run: {state!r}; queue: {slurm('squeue', '-t', 'all')!r}")
            assert not problems, "\n".join(problems)
        finally:
            for pid in _still_running(old_job):  # what this test started, should a failed stop leave it
                os.kill(int(pid.split()[0]), signal.SIGKILL)


def test_a_dtf_sweeps_trials_are_slurm_jobs_side_by_side(tmp_path: Path) -> None:
    """hydra/sweeper=dtf with launcher=slurm: each trial is a job its trial process waits for, and
    rank 0 on the node reports to the study's journal file in the (shared) sweep dir."""
    sweep_dir = tmp_path / "sweep"
    args = [
        *SHORT,
        "trainer.max_steps=null",
        "trainer.max_epochs=2",
        "launcher=slurm",
        "launcher.tasks_per_node=1",
        "hydra/sweeper=dtf",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.parallel=2",
        "optimizer.lr=tag(log,interval(1e-4,1e-2))",
    ]
    run = run_dtf(args, sweep_dir, multirun=True, timeout=400)
    assert "2 completed" in run.stdout, run.stdout
    records = [json.loads((sweep_dir / str(n) / "trial.json").read_text()) for n in range(2)]
    assert all(r["state"] == "complete" for r in records)
    assert max(r["started"] for r in records) < min(r["ended"] for r in records)  # both in the queue at once
    summaries = [json.loads((sweep_dir / str(n) / "summary.json").read_text()) for n in range(2)]
    assert {s["launcher"] for s in summaries} == {"slurm"}
    assert len({s["slurm_job_id"] for s in summaries}) == 2
    for s, r in zip(summaries, records, strict=True):
        assert s["objective"] == r["value"] and s["epochs"] == 2
    study = optuna.load_study(study_name="dtf", storage=open_storage(str(sweep_dir / "optuna.journal")))
    for trial, s in zip(study.trials, summaries, strict=True):  # epoch 1 reported from the job's rank 0
        assert trial.intermediate_values == {1: s["metrics_per_epoch"][0]["test/loss"]}
