"""Faults a user meets in their first month, each through the command line as they meet it: two runs
in one run directory, a holder killed with kill -9, what a run listens on, a run dir with spaces and
non-ASCII characters, a finished run run again (issue 31)."""

from __future__ import annotations

import shlex
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dtf.train.checkpoint import committed
from tests.helpers.cgroups import joining, memory_cgroup
from tests.helpers.run_command import (
    TEST_DEFAULTS,
    DtfRun,
    Started,
    dtf_command,
    require_unshare,
    run_command,
    run_dtf,
    start_command,
)
from tests.helpers.sockets import descendants, listening

# Every forward sleeps, so a run trains for seconds (100 steps of 2 ranks, 32 batches an epoch).
SLOW = [
    "model._target_=user_models.FailingModel",
    "+model.fail_rank=-1",
    "+model.delay_s=0.05",
    "data.dataset.num_points=2400",
    "data.dataset.num_test=400",
    "trainer.max_steps=100",
    "trainer.log_every_n_steps=10",
    "checkpoint.every_n_steps=20",
]


def _start(run_dir: Path, log: Path) -> Started:
    """`python -m dtf` in a session of its own (a kill of its group takes every process of the run),
    with the run dir quoted as Hydra's grammar wants it (spaces, non-ASCII)."""
    cmd = dtf_command(*TEST_DEFAULTS, *SLOW, f"hydra.run.dir='{run_dir}'")
    return start_command(cmd, log, cwd=log.parent, new_session=True)


def _finish(run_dir: Path, log: Path) -> DtfRun:
    with _start(run_dir, log) as proc:
        return DtfRun(proc.finish(expect=None), log.read_text(), "", run_dir)


@dataclass
class SharedDir:
    """Two runs started at once in one run dir, the winner killed with kill -9 mid-run, the same
    command again (it continues), and once more (the run is finished)."""

    run_dir: Path
    winner_pid: int
    refused: DtfRun
    refused_after_s: float
    sockets: list[tuple[int, str, int]]  # what the winner's processes listened on, mid-run
    newest_before_kill: int
    continued: DtfRun
    finished_files: dict[str, bytes]  # the run dir's record of itself after it finished
    again: DtfRun


def _record_of(run_dir: Path) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in ("summary.json", "model.pt")} | {
        str(p.relative_to(run_dir)): b"" for p in (run_dir / "tensorboard").glob("*")
    }


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> SharedDir:
    root = tmp_path_factory.mktemp("shared")
    run_dir = root / "my run dir ü"
    with _start(run_dir, root / "first.log") as first, _start(run_dir, root / "second.log") as second:
        started = time.monotonic()
        procs = (first, second)
        while all(p.poll() is None for p in procs) and time.monotonic() - started < 120:
            time.sleep(0.05)
        refused_proc = next(p for p in procs if p.poll() is not None)
        refused_after_s = time.monotonic() - started
        winner = second if refused_proc is first else first
        refused = DtfRun(refused_proc.wait(), refused_proc.output(), "", run_dir)
        log = winner.log
        while "step 40/" not in log.read_text() and winner.poll() is None and time.monotonic() - started < 240:
            time.sleep(0.05)
        assert winner.poll() is None, log.read_text()[-3000:]
        sockets = listening([winner.pid, *descendants(winner.pid)])
        winner.kill_everything()  # kill -9 of the whole run, as a lost node
    newest = int(committed(run_dir / "checkpoints")[0].name.removeprefix("step_"))
    continued = _finish(run_dir, root / "continued.log")
    finished_files = _record_of(run_dir) if continued.returncode == 0 else {}
    again = _finish(run_dir, root / "again.log")
    return SharedDir(run_dir, winner.pid, refused, refused_after_s, sockets, newest, continued, finished_files, again)


def test_a_second_run_in_a_held_run_dir_is_refused_in_one_line_naming_the_holder(shared_dir: SharedDir) -> None:
    refused = shared_dir.refused
    assert refused.returncode == 2, refused.stdout[-3000:]
    lines = [line for line in refused.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, refused.stdout[-3000:]
    assert lines[0].startswith(
        f"dtf: error: hydra.run.dir={shared_dir.run_dir} is in use by another run (pid {shared_dir.winner_pid} "
        f"on host {socket.gethostname()}, since "
    ), lines[0]
    assert lines[0].endswith("wait for that run to end, or give this run another hydra.run.dir"), lines[0]
    assert shared_dir.refused_after_s < 60  # before any rank of its own started


def test_a_holder_killed_with_kill_9_does_not_block_the_next_run_which_continues_it(shared_dir: SharedDir) -> None:
    continued = shared_dir.continued
    assert continued.returncode == 0, continued.stdout[-3000:]
    assert continued.summary["resumed_from_step"] == shared_dir.newest_before_kill >= 40
    assert continued.summary["global_step"] == 100


def test_a_run_dir_with_spaces_and_non_ascii_characters_trains_and_resumes(shared_dir: SharedDir) -> None:
    assert " " in shared_dir.run_dir.name and not shared_dir.run_dir.name.isascii()
    summary = shared_dir.continued.summary
    assert summary["run_dir"] == str(shared_dir.run_dir) and summary["resumed_from_step"] is not None
    assert (shared_dir.run_dir / "model.pt").is_file()


def test_a_single_node_run_listens_on_loopback_only(shared_dir: SharedDir) -> None:
    # the driver's rendezvous store, rank 0's process-group store, gloo's pairs: none on another interface
    pids = {pid for pid, _, _ in shared_dir.sockets}
    assert shared_dir.winner_pid in pids and len(pids) >= 3, shared_dir.sockets  # the driver and both ranks
    assert all(address == "127.0.0.1" for _, address, _ in shared_dir.sockets), shared_dir.sockets


def test_a_finished_run_run_again_says_so_and_leaves_its_record_as_it_was(shared_dir: SharedDir) -> None:
    again = shared_dir.again
    assert again.returncode == 0, again.stdout[-3000:]
    assert (
        "dtf: this run already finished at step 100 (its summary.json and model.pt are left as they are): raise "
        "trainer.max_steps or trainer.max_epochs to train on, or start over with checkpoint.resume=never or another "
        "hydra.run.dir"
    ) in again.stdout
    assert "nan" not in again.stdout and "final" not in again.stdout
    assert _record_of(shared_dir.run_dir) == shared_dir.finished_files  # bit for bit, no new event file


def test_a_hung_rank_is_named_and_killed_long_before_the_collective_timeout(tmp_path: Path) -> None:
    # Rank 1's 10th forward never returns; rank 0 goes on to backward and waits there for it.
    hung_at = tmp_path / "hung_at"
    hang = ["model._target_=user_models.FailingModel", "+model.how=hang", "+model.fail_at_call=10"]
    args = [*hang, f"+model.fill_path={hung_at}", "trainer.stall_timeout_s=3", "trainer.dist_timeout_s=600"]
    run = run_dtf(args, tmp_path / "run", timeout=300, expect=1)
    ended = time.time()
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "dtf: error: rank 1 failed: made no progress for 3 s in forward of step 10 (trainer.stall_timeout_s: 3 s), "
            f"while rank(s) 0 waited for it; it was killed (its logs: {tmp_path / 'run' / 'logs'}"
        )
    ), run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    # stall timeout, the driver's poll, a heartbeat's delay, the run's end: no 30 s grace, no 600 s timeout
    assert ended - float(hung_at.read_text()) < 20


def test_a_hung_rank_is_named_when_a_short_collective_timeout_ends_the_run_first(tmp_path: Path) -> None:
    # The collective timeout (5 s) runs out long before the stall timeout (300 s): rank 0's wait in
    # backward fails first, but rank 1, hung in its forward, got least far, and is the one named.
    hang = ["model._target_=user_models.FailingModel", "+model.how=hang", "+model.fail_at_call=10"]
    run = run_dtf([*hang, "trainer.dist_timeout_s=5"], tmp_path / "run", timeout=300, expect=1)
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "dtf: error: rank 1 failed: made no progress in forward of step 10 while rank(s) 0 waited for it, until "
            "the collective timeout (trainer.dist_timeout_s: 5 s) ended the run (rank 0: "
        )
    ), run.stderr[-3000:]
    assert "Traceback" not in run.stderr


# A user's script as it is often first written: no `if __name__ == "__main__":` guard, a model
# class of its own that a config cannot name (the ranks never run the script), then a run.
SCRIPT = """
import sys
import torch
import dtf


class Net(torch.nn.Linear):
    pass


try:
    dtf.run(["model._target_=__main__.Net"], run_dir=sys.argv[1] + "/refused")
except dtf.UserError as e:
    print("refused:", e)
summary = dtf.run(["trainer.max_steps=3", "trainer.progress=off"], run_dir=sys.argv[1] + "/run")
print("steps:", summary["global_step"])
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_a_script_without_a_main_guard_runs_and_names_no_class_of_its_own(tmp_path: Path, how: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, str(script) if how == "file" else "-", str(tmp_path)]
    done = run_command(cmd, input=SCRIPT if how == "stdin" else None, timeout=300)
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "refused: model._target_=__main__.Net names Net in the script that runs dtf, which the ranks do not run: put "
        "Net in a module of its own that they can import (a .py file next to the script, on PYTHONPATH) and name it "
        "there, or pass it to dtf.run_function(module=Net), which ships it to the ranks"
    ), done.stdout[-3000:]
    assert lines[-1] == "steps: 3", done.stdout[-3000:]
    assert not (tmp_path / "refused").exists()  # refused before anything was written


def _parquet(directory: Path, files: int, rows: int) -> Path:
    """Plain Parquet as pyarrow writes it: `features` (2 floats) and `y`, z = sin(y) + cos(x)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True)
    for i in range(files):
        x = np.random.default_rng(i).uniform(-5, 5, size=(rows, 2)).astype(np.float32)
        table = pa.table({"features": pa.array(list(x)), "y": pa.array(np.sin(x[:, 1]) + np.cos(x[:, 0]))})
        pq.write_table(table, directory / f"part-{i}.parquet")
    return directory


PARQUET = ["data=petastorm", "data.label_column=y", "data.feature_columns=[features]"]


def test_a_parquet_file_deleted_while_the_run_reads_is_one_line_in_bounded_time(tmp_path: Path) -> None:
    # Rank 1 deletes one of the 4 files at its 3rd step; the epochs after it cannot read it.
    data = _parquet(tmp_path / "data", files=4, rows=500)
    remove = ["model._target_=user_models.FailingModel", "+model.how=remove", "+model.fail_at_call=3"]
    started = time.monotonic()
    run = run_dtf(
        [*PARQUET, f"data.path={data}", *remove, f"+model.fill_path={data / 'part-3.parquet'}"],
        tmp_path / "run",
        expect=2,
    )
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dtf: error: data.path=file://{data}"), run.stderr[-3000:]
    assert time.monotonic() - started < 120  # not the collective timeout (TEST_DEFAULTS: 60 s) and its grace


def test_data_too_small_for_every_rank_to_have_a_batch_is_refused_on_the_driver(tmp_path: Path) -> None:
    data = _parquet(tmp_path / "data", files=1, rows=10)
    run = run_dtf([*PARQUET, f"data.path={data}", "data.batch_size=8"], tmp_path / "run", expect=2)
    assert run.stderr.strip().splitlines() == [
        f"dtf: error: data.path=file://{data} has 10 rows, fewer than world size x data.batch_size = 2 x 8 = 16: every "
        "rank needs a full batch; lower data.batch_size, start fewer ranks, or add rows"
    ]
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


def test_a_full_disk_during_prepare_is_one_line_and_leaves_the_data_there_as_it_was(tmp_path: Path) -> None:
    require_unshare("give --out a small tmpfs")
    # --out on a small tmpfs of its own: a first prepare fits; the disk is filled; a second one, of
    # more points, finds no space. It wrote over the first's files (rmtree, then write), and ended
    # in a traceback with exit 1.
    disk, out = tmp_path / "disk", tmp_path / "disk" / "data"
    disk.mkdir()
    prepare = shlex.join(dtf_command("scalar_field", f"--out={out}", module="dtf.data.prepare"))
    script = f"""
        mount -t tmpfs -o size=2m tmpfs {disk} || exit 99
        {prepare} >/dev/null || exit 98
        sha256sum {out}/scalar_field/parquet/*/* >{tmp_path}/before.sha
        dd if=/dev/zero of={disk}/ballast bs=64k 2>/dev/null
        {prepare} --set num_points=20000 >{tmp_path}/full.out 2>{tmp_path}/full.err
        echo $? >{tmp_path}/full.status
        sha256sum {out}/scalar_field/parquet/*/* >{tmp_path}/after.sha
        ls -a {out}/scalar_field/parquet >{tmp_path}/after.ls
    """
    run_command(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, timeout=300)
    err = (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.status").read_text().strip() == "2", err[-3000:]
    assert err.strip().splitlines() == [
        f"dtf: error: --out {out}: no space left on the device of {out}; nothing is left half written: free space "
        "there, or give --out a folder on a larger disk"
    ]
    assert (tmp_path / "after.sha").read_text() == (tmp_path / "before.sha").read_text()  # the data as it was
    assert ".train.partial" not in (tmp_path / "after.ls").read_text().split()


def test_a_full_disk_at_the_end_of_training_is_one_line(tmp_path: Path) -> None:
    require_unshare("give the run dir a small tmpfs")
    # The disk fills at the last step, with no checkpoint to save: the writes at the end fail
    # (TensorBoard's hparams, model.pt, summary.json). It ended in a JSONDecodeError traceback
    # (the rank's own error record, on the same disk, was left empty) with exit 1.
    disk, run_dir = tmp_path / "disk", tmp_path / "disk" / "run"
    disk.mkdir()
    args = [
        "model._target_=user_models.FailingModel",
        "data.dataset.num_points=2400",
        "data.dataset.num_test=400",
        "trainer.max_steps=40",
        "checkpoint.every_n_steps=null",
        "checkpoint.at_end=false",
        "+model.how=fill_disk",
        "+model.fail_at_call=40",
        f"+model.fill_path={disk / 'ballast'}",
    ]
    dtf = shlex.join(dtf_command(*TEST_DEFAULTS, *args, f"hydra.run.dir={run_dir}"))
    script = f"""
        mount -t tmpfs -o size=64m tmpfs {disk} || exit 99
        {dtf} >{tmp_path}/full.out 2>{tmp_path}/full.err
        echo $? >{tmp_path}/full.status
    """
    run_command(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, timeout=300)
    err = (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.status").read_text().strip() == "2", err[-3000:]
    assert err.strip().splitlines() == [
        f"dtf: error: no space left on the device of {run_dir}: free space there, or put the run directory on a "
        "larger disk (hydra.run.dir); the same command then continues from the newest checkpoint (rank 0)"
    ], err[-3000:]


def test_async_save_with_a_small_dev_shm_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    require_unshare("give the run a small /dev/shm")
    # /dev/shm as small as some containers have it (here 64 kB, under the default job's 126 kB of state).
    # It ended in torch's "unable to allocate shared memory(shm) ..." as a rank's failure, exit 1.
    run_dir = tmp_path / "run"
    dtf = shlex.join(
        dtf_command(
            *TEST_DEFAULTS,
            "checkpoint.async_save=true",
            "trainer.max_steps=30",
            "checkpoint.every_n_steps=10",
            f"hydra.run.dir={run_dir}",
        )
    )
    script = f"""
        mount -t tmpfs -o size=64k tmpfs /dev/shm || exit 99
        {dtf} >{tmp_path}/out 2>{tmp_path}/err
        echo $? >{tmp_path}/status
    """
    run_command(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, timeout=300)
    err = (tmp_path / "err").read_text()
    assert (tmp_path / "status").read_text().strip() == "2", err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "dtf: error: checkpoint.async_save=true copies this rank's state (126,036 bytes) into shared memory, and "
        "/dev/shm has no room for it"
    ), err[-3000:]
    assert "or set checkpoint.async_save=false (rank " in lines[0]


def test_a_rank_killed_by_the_oom_killer_is_said_to_be_out_of_memory(tmp_path: Path) -> None:
    # The run in a memory cgroup of 3 GiB (as in a container or a SLURM job's cgroup); rank 1's 3rd
    # forward takes memory until the kernel's OOM killer ends it.
    oom = ["model._target_=user_models.FailingModel", "+model.how=oom"]
    with memory_cgroup(3 << 30) as cgroup:
        run = run_dtf(oom, tmp_path / "run", prefix=joining(cgroup), timeout=300, expect=1)
        kills = cgroup / ("memory.oom_control" if (cgroup / "memory.oom_control").exists() else "memory.events")
        assert "oom_kill 1" in kills.read_text()  # the kernel's own count: one process, the rank
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "dtf: error: rank 1 failed: out of memory: the kernel's OOM killer killed it (SIGKILL; oom_kill 0 -> 1 in "
        f"{kills}): lower data.batch_size, shard the model's state (strategy=zero or strategy=fsdp), or give the "
        "run more memory ("
    ), run.stderr[-3000:]
    assert "Traceback" not in run.stderr
