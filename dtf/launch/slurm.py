"""Ranks as the tasks of a SLURM job, submitted with submitit.

Three situations, one command (`python -m dtf launcher=slurm ...`):
- on a login node: submitit writes an sbatch script (one task per rank) and submits it; the
  driver streams rank 0's output and ends with the job's status (or, with launcher.wait=false,
  prints the job id and returns);
- inside an allocation (`salloc`, or the batch script of an `sbatch` the user wrote): the
  ranks are started in place as one `srun` step; the driver writes the config it resolved (and
  the rank function) to <run_dir>/slurm/, and every task loads it from there (srun_task_main),
  so a sweep's points each run once, in their own run dir;
- as a task of `srun`: this process is a rank already and runs in place.
In each task the rendezvous comes from the SLURM environment (submitit's
TorchDistributedEnvironment: the allocation's first node, a port derived from the job id).

Elastic jobs (launcher.nodes=MIN:MAX): sbatch --nodes=MAX --no-kill, and one task per node
that runs torch's elastic agent with the node's ranks (dtf.launch.local, as launcher=local's
nnodes=MIN:MAX), the agents meeting at the first node. A node that fails leaves the job (--no-kill)
and the agents left go on without it, from the newest checkpoint, at the same global batch.

Preemption and time limits: SLURM sends launcher.signal (SIGUSR1 by default, launcher.signal_delay_s
before the end); the ranks agree, checkpoint and stop (dtf.signals), rank 0 requeues the job
with `scontrol requeue`, and the requeued job resumes from that checkpoint in the same run dir.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dtf import elastic, failures, hydra_sweep
from dtf.config.schema import CheckpointConfig, LocalLauncherConfig, SlurmLauncherConfig
from dtf.config.typed import RunConfig
from dtf.errors import RankFailedError, TooFewNodes, UserError
from dtf.launch.base import Launcher, LogTail, WorkerFn, in_place_result, rank_result
from dtf.results import EXIT_STOPPED, Finished, RunResult, Stopped, Submitted

JOB_FOLDER = "slurm"  # under the run dir: sbatch script, pickles, every task's stdout/stderr
# Inside an allocation, in JOB_FOLDER: what every task of the srun step runs, and each task's outcome.
STEP_TASK_FILE = "step_task.pkl"
STEP_RESULT_FILE = "step_rank{rank}_result.pkl"


def inside_srun_task() -> bool:
    return "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ


def inside_allocation() -> bool:
    return "SLURM_JOB_ID" in os.environ


class SlurmRank:
    """What every task of the job runs (pickled by submitit): join the group, train, report."""

    def __init__(self, fn: WorkerFn, run: RunConfig, run_dir: str, requeue: bool) -> None:
        self.fn, self.run, self.run_dir, self.requeue = fn, run, run_dir, requeue

    def __call__(self) -> RunResult | None:
        return run_as_task(self.fn, self.run, self.run_dir, requeue=self.requeue)


def run_as_task(fn: WorkerFn, run: RunConfig, run_dir: str, requeue: bool) -> RunResult | None:
    """One SLURM task = one rank, in this process."""
    import submitit

    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # set in submitit's own jobs; not under a user's srun
    dist = submitit.helpers.TorchDistributedEnvironment()
    # GPUs: SLURM's --gpus-per-task (or the local rank) picks the device, not CUDA_VISIBLE_DEVICES.
    dist.export(set_cuda_visible_devices=False, overwrite=True)
    result = fn(run, run_dir)  # a failure is recorded for the driver (dtf.failures) and ends the task
    if requeue and isinstance(result, Stopped):
        if dist.rank == 0:
            # As submitit does on preemption; the requeued job finds the checkpoint in the same run dir.
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True, timeout=60)
            print(f"dtf: stopped at step {result.step}; requeued SLURM job {os.environ['SLURM_JOB_ID']}", flush=True)
        # No result file is written: the driver keeps waiting, for the requeued job's.
        raise SystemExit(EXIT_STOPPED)
    return result


class SlurmNode:
    """What every task of an elastic job runs (one task per node, pickled by submitit)."""

    def __init__(
        self, fn: WorkerFn, run: RunConfig, run_dir: str, launcher: SlurmLauncherConfig, checkpoint: CheckpointConfig
    ) -> None:
        self.fn, self.run, self.run_dir, self.launcher, self.checkpoint = fn, run, run_dir, launcher, checkpoint

    def __call__(self) -> RunResult | NodeFailed | None:
        return run_as_node(self.fn, self.run, self.run_dir, self.launcher, self.checkpoint)


@dataclass(frozen=True)
class NodeFailed:
    """How an elastic job's node ended when its ranks could not finish: the line the driver prints."""

    message: str
    user_error: bool  # exit status 2 (bad input), else 1


def run_as_node(
    fn: WorkerFn, run: RunConfig, run_dir: str, c: SlurmLauncherConfig, checkpoint: CheckpointConfig
) -> RunResult | NodeFailed | None:
    """One node of an elastic job: torch's elastic agent with this node's ranks (launcher=local's
    engine), meeting the agents of the job's other nodes at its first node. Rank 0's node returns
    its result; the others None. A failure is returned as a NodeFailed (its one line), not raised:
    with --no-kill, SLURM would not end the other nodes' tasks for it, and they end by themselves."""
    import submitit

    from dtf.launch.local import LocalLauncher, newest_checkpoint

    low, high = c.node_range()
    hosts = submitit.JobEnvironment().hostnames
    node = LocalLauncherConfig(
        nproc=c.tasks_per_node,
        nnodes=f"{low}:{high}",
        rdzv_endpoint=f"{hosts[0]}:{step_port()}",
        node_rank=int(os.environ["SLURM_NODEID"]),  # the first node hosts the rendezvous
        rdzv_configs=dict(c.rdzv_configs),
        env=dict(c.env),
    )
    job = os.environ["SLURM_JOB_ID"]
    try:
        result = LocalLauncher(node, checkpoint).launch(fn, run, run_dir)
    except TooFewNodes:
        newest = newest_checkpoint("", Path(run_dir) / checkpoint.dir)
        kept = f"its newest checkpoint, step {newest.step}, is intact" if newest.checkpoint else "it has no checkpoint"
        wait = c.rdzv_configs.get("join_timeout", 600)
        if c.requeue:
            if node.node_rank == 0:  # the first node: the others have the same error
                subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
                print(f"dtf: fewer than {low} node(s) met in {wait} s; {kept}; requeued SLURM job {job}", flush=True)
            raise SystemExit(EXIT_STOPPED) from None  # no result: the driver waits for the requeued job
        return NodeFailed(
            f"fewer than {low} node(s) of SLURM job {job} (launcher.nodes={c.nodes}) met within {wait} s "
            f"(launcher.rdzv_configs.join_timeout), and launcher.requeue=false: the run stopped, and {kept}; "
            "the same command continues it",
            user_error=False,
        )
    except UserError as e:  # told in one line by the agent: the rank that failed, a lost node
        return NodeFailed(str(e), user_error=not isinstance(e, RankFailedError))
    if c.requeue and isinstance(result, Stopped):  # preempted (rank 0's node): as run_as_task
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
        print(f"dtf: stopped at step {result.step}; requeued SLURM job {job}", flush=True)
        raise SystemExit(EXIT_STOPPED)
    return result


def step_port() -> int:
    """The rendezvous port of this srun step's ranks. submitit derives one from the job id alone:
    steps of one allocation (a sweep's points, or runs side by side) would all use the same one."""
    step = f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
    return random.Random(step).randint(20000, 60000)


def srun_task_main() -> None:
    """What every task of an in-allocation srun step runs (`python -c ... <task file>`): the rank
    function and the config the driver resolved, loaded from the task file; the result goes to a
    file next to it, where the driver reads it (a failure is recorded by the rank function)."""
    from submitit.core.utils import cloudpickle_dump, pickle_load, temporary_save_path

    task_file = Path(sys.argv[1])
    fn, run, run_dir = pickle_load(task_file)
    rank = int(os.environ["SLURM_PROCID"])
    os.environ.setdefault("MASTER_PORT", str(step_port()))
    result_file = task_file.parent / STEP_RESULT_FILE.format(rank=rank)

    try:
        result = run_as_task(fn, run, run_dir, requeue=False)
    except Exception:
        # Recorded already (dtf.failures); the driver prints it once. This task's output is the
        # terminal's, so no second traceback here: a non-zero exit, and srun ends the other tasks.
        raise SystemExit(1) from None
    with temporary_save_path(result_file) as tmp:  # whole or not at all: srun may kill this task
        cloudpickle_dump(result, tmp)


class SlurmLauncher(Launcher):
    cfg: SlurmLauncherConfig

    def launch(self, fn: WorkerFn, run: RunConfig, run_dir: str) -> RunResult | None:
        if self.cfg.elastic and inside_allocation():
            raise UserError(
                f"launcher.nodes={self.cfg.nodes}: an elastic job is one sbatch job whose nodes each run torch's "
                "elastic agent; run this command where jobs are submitted, not inside an allocation (there, run "
                "launcher=local launcher.nnodes=MIN:MAX on every node: srun --no-kill --ntasks-per-node=1 ...)"
            )
        if inside_srun_task():  # the user's srun owns the job; this process is a rank
            return in_place_result(run_as_task(fn, run, run_dir, requeue=False))
        failures.clear(run_dir)
        if inside_allocation():
            return self._srun_in_allocation(fn, run, run_dir)
        return self._submit(fn, run, run_dir)

    def _srun_in_allocation(self, fn: WorkerFn, run: RunConfig, run_dir: str) -> RunResult:
        """The ranks as one srun step of the allocation this driver runs in. They get the config
        as it was resolved here (pickled in the run dir), never this process's command line."""
        from submitit.core.utils import cloudpickle_dump

        c = self.cfg
        folder = Path(run_dir) / JOB_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        tasks = c.nproc
        for rank in range(tasks):  # an earlier run in this run dir (a resumed one) left its own
            (folder / STEP_RESULT_FILE.format(rank=rank)).unlink(missing_ok=True)
        task_file = folder / STEP_TASK_FILE
        cloudpickle_dump((fn, run, run_dir), task_file)
        cmd = [
            "srun",
            f"--nodes={c.nodes}",
            f"--ntasks-per-node={c.tasks_per_node}",
            f"--cpus-per-task={c.cpus_per_task}",
            "--kill-on-bad-exit=1",  # a failed rank ends the step: the others never hang
            sys.executable,
            "-c",
            "from dtf.launch.slurm import srun_task_main; srun_task_main()",
            str(task_file),
        ]
        code = subprocess.call(cmd)
        return step_result(folder, run_dir, code)

    def _executor(self, run_dir: str, nodes: int) -> Any:
        import submitit
        from submitit.slurm.slurm import SlurmJobEnvironment

        if shutil.which("sbatch") is None:
            raise UserError(
                "launcher=slurm: sbatch is not on PATH: run on a machine with SLURM's client tools "
                "(scripts/local-slurm.sh start sets up one here), or use launcher=local"
            )
        c = self.cfg
        signal_name = c.signal.removeprefix("SIG")
        # submitit writes --signal=<USR_SIG>@<delay> into the sbatch script from this attribute.
        SlurmJobEnvironment.USR_SIG = signal_name
        executor = submitit.AutoExecutor(folder=Path(run_dir) / JOB_FOLDER, cluster="slurm")
        extra = dict(c.sbatch_extra)
        extra.update({key: getattr(c, key) for key in ("account", "qos") if getattr(c, key)})
        # An elastic job starts on MAX nodes (a range --nodes=MIN-MAX gets its minimum from SLURM, and a
        # running job gains no nodes), keeps the others when one fails (--no-kill), and runs one task
        # per node: its agent starts the node's ranks.
        per_node = (1, c.tasks_per_node * c.cpus_per_task) if c.elastic else (c.tasks_per_node, c.cpus_per_task)
        if c.elastic:
            extra["no_kill"] = True
        executor.update_parameters(
            name=f"dtf-{Path(run_dir).name}",
            nodes=nodes,
            tasks_per_node=per_node[0],
            cpus_per_task=per_node[1],
            gpus_per_node=c.gpus_per_node or None,
            timeout_min=c.time_min,
            slurm_partition=c.partition,
            slurm_signal_delay_s=c.signal_delay_s,
            slurm_additional_parameters=extra,
            slurm_setup=[f"export SUBMITIT_PREEMPT_SIGNAL={signal_name}", *c.setup],
            # A rank that fails (its error recorded for the driver) ends the job's other tasks at once,
            # instead of leaving them waiting in a collective until trainer.dist_timeout_s.
            # An elastic job's step outlives a failed node (--no-kill): the agents left go on without it.
            slurm_srun_args=["--no-kill"] if c.elastic else ["--kill-on-bad-exit=1"],
            **({"mem_gb": c.mem_gb} if c.mem_gb else {}),
        )
        return executor

    def _submit(self, fn: WorkerFn, run: RunConfig, run_dir: str) -> RunResult:
        import submitit

        if not self.cfg.wait and hydra_sweep.wants_values():
            raise UserError(
                "launcher.wait=false: this sweeper chooses its next points by the last ones' objectives, "
                "which a job not waited for cannot give; drop launcher.wait=false (or sweep with Hydra's basic sweeper)"
            )
        logging.getLogger("submitit").setLevel(logging.ERROR)  # dtf reports the job's progress itself
        nodes = self.cfg.nodes
        if self.cfg.elastic:  # the most nodes that keep the global batch (dtf.elastic)
            plan = elastic.plan(run)
            nodes = plan.max_nodes if plan is not None else self.cfg.node_range()[1]
        executor = self._executor(run_dir, nodes)
        try:
            task = SlurmNode(fn, run, run_dir, self.cfg, self.checkpoint) if self.cfg.elastic else None
            job = executor.submit(task or SlurmRank(fn, run, run_dir, self.cfg.requeue))
        except submitit.core.utils.FailedJobError as e:  # sbatch refused it: its own words, one line
            reason = " ".join(str(e).split("\n")[-3:]).strip()
            raise UserError(f"launcher=slurm: sbatch refused the job: {reason}") from None
        print(f"dtf: submitted SLURM job {job.job_id}; logs in {Path(run_dir) / JOB_FOLDER}", flush=True)
        c = self.cfg
        # What the job asks each node for, as the user set it (an elastic job runs one task per node,
        # the node's agent, with CPUs for all of its ranks).
        asked = f"{nodes} node(s) x {c.tasks_per_node} task(s) x {c.cpus_per_task} CPU(s)"
        tasks = (nodes, True, asked) if c.elastic else (c.nproc, False, asked)
        # Hydra's basic sweeper: every point is submitted first; SweepJobs waits for them all at the end.
        # Any other sweeper needs each point's objective before it picks the next: waited for here.
        if hydra_sweep.in_basic_sweep():
            SUBMITTED.append((job, run_dir, *tasks))
            return Submitted(job.job_id)
        if not self.cfg.wait:
            from submitit.core.utils import JobPaths

            rank0_log = JobPaths(job.paths.folder, job.job_id, task_id=0).stdout
            print(
                f"dtf: not waiting (launcher.wait=false): the job's result will be {Path(run_dir) / 'summary.json'}; "
                f"follow it with `squeue -j {job.job_id}` and `tail -f {rank0_log}`",
                flush=True,
            )
            return Submitted(job.job_id)
        return wait_for(job, run_dir, *tasks)


# Jobs of this process's sweep (Hydra's basic sweeper), waited for by SweepJobs once all are submitted.
SUBMITTED: list[tuple[Any, str, int, bool, str]] = []


class SweepJobs(Callback):
    """Hydra callback: at the end of a multirun, waits for the SLURM jobs it submitted (which run in
    parallel as far as the cluster allows) and reports each one; fails if any did."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failed = 0
        while SUBMITTED:
            job, run_dir, tasks, elastic, asked = SUBMITTED.pop(0)
            try:
                result = wait_for(job, run_dir, tasks, elastic, asked, stream=False)
                if isinstance(result, Finished):
                    loss = result.summary["final_train_loss"]
                    done = f"final train loss {loss:.6g}; summary {Path(run_dir) / 'summary.json'}"
                else:
                    done = f"stopped at step {result.step}"
                print(f"dtf: SLURM job {job.job_id} done: {done}", flush=True)
            except UserError as e:
                failed += 1
                print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        if failed:
            raise SystemExit(1)


# States after which a job runs no more (a requeued job passes through REQUEUED and PENDING instead).
_FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# Reasons a pending job waits for something that will not come by itself (SLURM leaves such
# jobs pending unless EnforcePartLimits is set): asking for more than the partition has, and the like.
_NEVER_STARTS = {
    "PartitionConfig",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "QOSMaxCpuPerJobLimit",
    "QOSMaxNodePerJobLimit",
    "QOSMaxWallDurationPerJobLimit",
}


def job_state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) from squeue, which keeps finished jobs for MinJobAge; None once it is gone.
    Not sacct: clusters without accounting storage have no sacct (submitit's watcher needs it)."""
    try:
        out = subprocess.run(
            # -t all: with -j alone, squeue leaves out a job that has ended
            ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T %r"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return ("UNKNOWN", "")
    return (out[0], out[1] if len(out) > 1 else "") if out else None


# How long the driver waits, once every rank's result is in, for the job to leave the queue (its
# steps end, then it is COMPLETING until SLURM has cleaned up after them: KillWait, epilog).
LEAVE_QUEUE_S = 120.0


def wait_for(job: Any, run_dir: str, tasks: int, elastic: bool, asked: str, stream: bool = True) -> Finished | Stopped:
    """Streams rank 0's output while the job runs (through requeues), then returns its result once
    the job has left the queue: not while it still runs or is COMPLETING, so that whoever comes next
    (another job, `scripts/local-slurm.sh stop`) finds the node free. elastic: the tasks are the
    job's nodes, any of which may hold rank 0's result, and a lost node's none. asked: what the job
    asked SLURM for, in the user's terms."""
    from submitit.core.utils import JobPaths, pickle_load

    paths = [JobPaths(job.paths.folder, job.job_id, task_id=i) for i in range(tasks)]
    # submitit's own bookkeeping lines are not the user's output
    tail = LogTail(paths[0].stdout, hide=lambda line: "submitit " in line)
    ended_at: float | None = None
    results_at: float | None = None
    while True:
        if stream:
            tail.print_new()
        state = job_state(job.job_id)
        if state is not None and state[0] == "PENDING" and state[1] in _NEVER_STARTS:
            subprocess.run(["scancel", job.job_id], timeout=60)  # our own job, which would wait forever
            raise UserError(
                f"launcher=slurm: SLURM job {job.job_id} can never start (pending for {state[1]}): the partition "
                f"cannot give {asked}; "
                "lower launcher.nodes, launcher.tasks_per_node or launcher.cpus_per_task, or pick launcher.partition"
            )
        have_results = node_outcome(paths) is not None if elastic else all(p.result_pickle.exists() for p in paths)
        if state is None or state[0] in _FINAL_STATES:
            if have_results:
                break
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > 10:  # result files of a finished job appear within seconds
                break
        else:
            ended_at = None  # a requeued job comes back
            if have_results:
                results_at = results_at or time.monotonic()
                if time.monotonic() - results_at > LEAVE_QUEUE_S:
                    print(
                        f"dtf: warning: every rank of SLURM job {job.job_id} has finished, but the job is still "
                        f"{state[0]} after {LEAVE_QUEUE_S:.0f}s; not waiting for it any longer",
                        file=sys.stderr,
                        flush=True,
                    )
                    break
        time.sleep(0.2 if have_results else 1.0)
    if stream:
        tail.print_new()
    if elastic:  # the result counts: failures recorded on the way are of worlds the run recovered from
        return elastic_result(job.job_id, paths)
    first = failures.blamed(run_dir)
    if first is not None:  # a rank failed (and srun --kill-on-bad-exit ended the others)
        raise failures.report(first, str(paths[first.rank].stderr))
    outcome = pickle_load(paths[0].result_pickle) if paths[0].result_pickle.exists() else None
    if outcome is None or outcome[0] != "success":
        ended = (job_state(job.job_id) or ("gone",))[0]
        raise RankFailedError(
            f"SLURM job {job.job_id} ended ({ended}) without a result from rank 0: see {paths[0].stderr}"
        )
    return rank_result(outcome[1])


def node_outcome(paths: list[Any]) -> Finished | Stopped | NodeFailed | None:
    """An elastic job's end so far: rank 0's result, else a node's failure, from any node's task."""
    from submitit.core.utils import pickle_load

    failed = None
    for path in paths:
        try:
            outcome = pickle_load(path.result_pickle)
        except (OSError, EOFError, pickle.UnpicklingError):  # not there (yet), or a node lost while writing
            continue
        if outcome[0] == "success" and isinstance(outcome[1], Finished | Stopped):
            return outcome[1]
        if outcome[0] == "success" and isinstance(outcome[1], NodeFailed):
            failed = failed or outcome[1]
    return failed


def elastic_result(job_id: str, paths: list[Any]) -> Finished | Stopped:
    outcome = node_outcome(paths)
    if isinstance(outcome, NodeFailed):
        raise (UserError if outcome.user_error else RankFailedError)(outcome.message)
    if outcome is None:
        ended = (job_state(job_id) or ("gone",))[0]
        raise RankFailedError(
            f"SLURM job {job_id} ended ({ended}) without a result from rank 0's node: see {paths[0].stderr}"
        )
    return outcome


def step_result(folder: Path, run_dir: str, code: int) -> RunResult:
    """Rank 0's result of an in-allocation srun step (its result file, srun's exit code)."""
    from submitit.core.utils import pickle_load

    first = failures.blamed(run_dir)
    if first is not None:
        raise failures.report(first)  # the tasks' output went to this terminal
    result_file = folder / STEP_RESULT_FILE.format(rank=0)
    if code or not result_file.exists():
        raise RankFailedError(f"srun in allocation {os.environ['SLURM_JOB_ID']} failed with exit code {code}")
    return rank_result(pickle_load(result_file))
