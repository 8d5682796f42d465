"""Faults of the files a run reads and writes, each as a user meets it (issue 49): Parquet files
that disagree on a list column's length, a data reader's worker process killed, a read-only run
directory and a checkpoints folder made read-only mid-run."""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dtf.errors import UserError
from dtf.train.checkpoint import newest_complete, verify
from tests.helpers.inprocess import compose_config
from tests.helpers.run_command import (
    TEST_DEFAULTS,
    dtf_command,
    require_unshare,
    run_command,
    run_dtf,
    start_command,
)
from tests.helpers.sockets import descendants

PARQUET = ["data=petastorm", "data.label_column=y", "data.feature_columns=[features]"]


def test_parquet_files_whose_list_column_differs_in_length_are_refused_naming_both_files(tmp_path: Path) -> None:
    # One file's `features` holds 3 numbers a row, the other's 2, as pandas writes them (list<float>).
    # It was found only when one chunk of steps read from both files, as "holds values of shape (2,)
    # in one row group and (3,) in another", naming no file: here the driver refuses it.
    data = tmp_path / "data"
    data.mkdir()

    def write(name: str, width: int, row_group_size: int) -> None:
        rows = np.arange(40)
        features = [np.full(width, r, dtype=np.float32) for r in rows]
        frame = pd.DataFrame({"features": features, "y": rows.astype(np.float32)})
        frame.to_parquet(data / name, row_group_size=row_group_size)

    write("a.parquet", 3, 40)
    write("b.parquet", 2, 40)
    with pytest.raises(UserError) as refused:
        compose_config([*PARQUET, f"data.path={data}"])
    assert str(refused.value) == (
        f"data.feature_columns: column 'features' holds lists of 3 values in {data / 'a.parquet'} but of 2 in "
        f"{data / 'b.parquet'}: every row needs one length; rewrite the files that disagree with lists of one length"
    )
    write("b.parquet", 3, 7)  # files that agree, in row groups of other sizes, are read
    compose_config([*PARQUET, f"data.path={data}"])


def _reader_workers_of_rank(driver: int, rank: int) -> list[int]:
    """The worker processes of a rank's data reader (a spawned process pool): the driver's
    descendants started by multiprocessing's spawn that carry the rank's RANK."""
    found = []
    for pid in descendants(driver):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if b"spawn_main" in cmdline and f"RANK={rank}".encode() in environ:
            found.append(pid)
    return found


def test_a_data_reader_worker_killed_is_one_line_naming_its_signal(tmp_path: Path) -> None:
    # A worker of rank 1's reader pool is killed with SIGKILL mid-run, as the kernel's OOM killer
    # kills one. It ended in "rank 1 failed: BrokenProcessPool: A child process terminated abruptly,
    # the process pool is not usable anymore" and a traceback.
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):  # many row groups: the reader's workers read all through the epoch
        x = rng.uniform(-1, 1, size=(1000, 2)).astype(np.float32)
        rows = pd.DataFrame({"features": list(x), "y": x.sum(axis=1)})
        rows.to_parquet(data / f"part-{i}.parquet", row_group_size=20)
    args = [
        *PARQUET,
        f"data.path={data}",
        "data.reader_pool_type=process",
        "model._target_=user_models.FailingModel",
        "+model.fail_rank=-1",
        "+model.delay_s=0.05",
        "trainer.max_steps=200",
        "trainer.log_every_n_steps=5",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    log, err = tmp_path / "out", tmp_path / "err"
    with start_command(dtf_command(*TEST_DEFAULTS, *args), log, err=err, cwd=tmp_path, new_session=True) as run:
        deadline = time.monotonic() + 180
        while "step 10/" not in log.read_text() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = _reader_workers_of_rank(run.pid, 1)
        assert workers, err.read_text()[-3000:]
        os.kill(workers[0], signal.SIGKILL)
        run.finish(expect=1, timeout=120)
    lines = err.read_text().strip().splitlines()
    assert len(lines) == 1, err.read_text()[-3000:]
    assert lines[0].startswith(
        f"dtf: error: rank 1 failed: the data reader's worker process {workers[0]} died (killed by signal SIGKILL; "
        f"the kernel's OOM killer sends it when memory runs out) while it read data.path=file://{data}: give the rank "
        "more memory, or lower data.workers_count or data.results_queue_size, or read in threads "
        "(data.reader_pool_type=thread) (its logs: "
    ), lines[0]


def _read_only(directory: Path) -> str:
    """Shell lines that make directory read-only in the test's mount namespace (a read-only bind
    mount of it over itself): chmod would not do, root and a user namespace's root write anyway."""
    return f"mount --bind {directory} {directory} && mount -o remount,ro,bind {directory} || exit 99"


def test_a_resume_in_a_read_only_run_dir_is_one_line_naming_it(tmp_path: Path) -> None:
    require_unshare("make the run dir read-only")
    # A run stopped at step 10, its run dir made read-only, then the command that continues it. It
    # ended in Hydra's "Set the environment variable HYDRA_FULL_ERROR=1 ..." and a traceback.
    run_dir = tmp_path / "run"
    run_dtf(["trainer.max_steps=10"], run_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    dtf = shlex.join(dtf_command(*TEST_DEFAULTS, "trainer.max_steps=20", f"hydra.run.dir={run_dir}"))
    script = f"""
        {_read_only(run_dir)}
        {dtf} >{tmp_path}/out 2>{tmp_path}/err
        echo $? >{tmp_path}/status
    """
    run_command(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, timeout=300)
    err = (tmp_path / "err").read_text()
    assert (tmp_path / "status").read_text().strip() == "2", err[-3000:]
    assert err.strip().splitlines() == [
        f"dtf: error: hydra.run.dir={run_dir} cannot be written (Read-only file system): make it writable (chmod -R "
        f"u+w {run_dir}, or mount it read-write) and run the same command again, or give hydra.run.dir a directory "
        "you can write to"
    ]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_checkpoints_folder_made_read_only_mid_run_is_one_line_naming_it(tmp_path: Path) -> None:
    require_unshare("make the checkpoints folder read-only")
    # checkpoints/ is made read-only once the save of step 20 is committed; the save of step 40
    # cannot be written. It ended in a traceback.
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    args = [
        "model._target_=user_models.FailingModel",
        "+model.fail_rank=-1",
        "+model.delay_s=0.05",
        "data.dataset.num_points=2400",
        "trainer.max_steps=100",
        "checkpoint.every_n_steps=20",
    ]
    dtf = shlex.join(dtf_command(*TEST_DEFAULTS, *args, f"hydra.run.dir={run_dir}"))
    script = f"""
        {dtf} >{tmp_path}/out 2>{tmp_path}/err &
        pid=$!
        while [ ! -e {checkpoints}/step_000000020/COMMITTED.json ] && kill -0 $pid 2>/dev/null; do sleep 0.05; done
        {_read_only(checkpoints)}
        wait $pid
        echo $? >{tmp_path}/status
    """
    run_command(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, timeout=300)
    err = (tmp_path / "err").read_text()
    assert (tmp_path / "status").read_text().strip() == "2", err[-3000:]
    assert err.strip().splitlines() == [
        f"dtf: error: {checkpoints} cannot be written (Read-only file system) while saving the checkpoint of step 40 "
        f"(of the earlier checkpoints, step_000000020 is intact and a rerun continues from it): make it writable "
        f"(chmod -R u+w {checkpoints}, or mount it read-write), or put checkpoints elsewhere (checkpoint.dir), then "
        "run the same command to continue"
    ], err[-3000:]
    newest = newest_complete(checkpoints)
    assert newest is not None and newest.name == "step_000000020" and verify(newest) == (True, "")
