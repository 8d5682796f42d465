"""Interrupted and resumed runs end exactly where uninterrupted ones end."""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dtf.results import EXIT_STOPPED
from dtf.train.checkpoint import MARKER, committed, is_complete
from tests.helpers.inprocess import train_on_ranks
from tests.helpers.run_command import (
    TEST_DEFAULTS,
    DtfRun,
    Started,
    dtf_command,
    is_running,
    require_unshare,
    run_command,
    run_dtf,
    start_command,
)
from tests.helpers.sockets import descendants

# Adam (state to restore), a step schedule after a warm-up (scheduler state), 32 batches per epoch.
COMMON = [
    "data.dataset.num_points=2400",
    "data.dataset.num_test=400",
    "scheduler=step",
    "scheduler.step_size=30",
    "trainer.warmup_steps=10",
    "checkpoint.every_n_steps=20",
]
N, K = 100, 45  # K is in the middle of the second epoch

STRATEGIES = {
    "ddp": ["strategy=ddp"],
    "zero3": ["strategy=zero", "strategy.stage=3"],
    "fsdp": ["strategy=fsdp"],
    "mics": ["strategy=mics", "strategy.partition_group_size=2", "launcher.nproc=4"],
}


@pytest.fixture(scope="module")
def straight_ddp(tmp_path_factory: pytest.TempPathFactory) -> DtfRun:
    """The uninterrupted reference run of COMMON (DDP on 2 ranks, N steps)."""
    return run_dtf([*COMMON, f"trainer.max_steps={N}"], tmp_path_factory.mktemp("straight") / "run")


# A stop signal a rank sends itself must land within these N steps (well under a second): the
# ranks compare notes every 10 steps, not every checkpoint.stop_check_every_s.
FAILING = [
    "model._target_=user_models.FailingModel",
    *COMMON,
    f"trainer.max_steps={N}",
    "checkpoint.stop_check_every_n_steps=10",
]


@pytest.fixture(scope="module")
def straight_failing(tmp_path_factory: pytest.TempPathFactory) -> DtfRun:
    """The uninterrupted reference for runs of FailingModel (whose failure is switched off here)."""
    return run_dtf([*FAILING, "+model.fail_rank=-1"], tmp_path_factory.mktemp("straight_failing") / "run")


def _same_run(a: DtfRun, b: DtfRun) -> None:
    sa, sb = a.summary, b.summary
    assert sa["params_sha256"] == sb["params_sha256"]
    assert sa["train_loss_per_epoch"] == sb["train_loss_per_epoch"]
    assert sa["test_loss_per_epoch"] == sb["test_loss_per_epoch"]
    assert sa["global_step"] == sb["global_step"]


def _resume_on_ranks(
    capfd: pytest.CaptureFixture[str], root: Path, world: int, whole: list[str], part: list[str]
) -> tuple[DtfRun, dict[str, Any], DtfRun]:
    """On gloo ranks the test starts (~1 s a run, not ~10 s through the command line; the ranks'
    body is the one `python -m dtf` runs): the straight run (whole) and the first part (part) on
    one start of the ranks, in root/straight and root/resumed; then the rest (whole again, in
    root/resumed) on fresh ranks, so that all it continues from is what the first part saved.
    Returns the straight run, the first part's summary, and the resumed run with what it printed."""
    first = train_on_ranks(world, [("straight", whole), ("resumed", part)], root)["resumed"]
    capfd.readouterr()  # below: what the resumed run says, and nothing before it
    train_on_ranks(world, [("resumed", whole)], root)
    return DtfRun(0, "", "", root / "straight"), first, DtfRun(0, capfd.readouterr().out, "", root / "resumed")


@pytest.mark.parametrize(
    "name",
    [
        # zero1's resume is test_zero1_resume_inside_the_warmup's (bit for bit, mid-epoch); an asynchronous
        # save's, test_a_rank_killed_in_a_save_is_named_and_the_rerun_ends_as_the_straight_run[async]'s
        "ddp",
        "fsdp",
        # zero2 checkpoints as zero3 does (FSDP2 either way, only resharding after forward differs)
        pytest.param("zero3", marks=pytest.mark.slow),
        pytest.param("mics", marks=pytest.mark.slow),
    ],
)
def test_resume_mid_epoch_ends_bit_for_bit_where_the_straight_run_ends(
    tmp_path: Path, name: str, straight_ddp: DtfRun, capfd: pytest.CaptureFixture[str]
) -> None:
    args = [*COMMON, *STRATEGIES[name]]
    if name == "ddp":  # through the command line, as a user resumes
        straight = straight_ddp
        first = run_dtf([*args, f"trainer.max_steps={K}"], tmp_path / "resumed").summary
        resumed = run_dtf([*args, f"trainer.max_steps={N}"], tmp_path / "resumed")
    else:  # the sharded strategies (they launch as DDP does) on ranks the test starts
        world = 4 if name == "mics" else 2
        whole, part = [*args, f"trainer.max_steps={N}"], [*args, f"trainer.max_steps={K}"]
        straight, first, resumed = _resume_on_ranks(capfd, tmp_path, world, whole, part)
    assert first["resumed_from_step"] is None
    if name == "fsdp":  # gathered from the shards, in the module's order all the same
        from tests.e2e.test_cli import _loads_by_position

        _loads_by_position(straight.run_dir / "model.pt")
    assert resumed.summary["resumed_from_step"] == K
    assert f"resumed from {tmp_path / 'resumed' / 'checkpoints' / f'step_{K:09d}'}" in resumed.stdout
    _same_run(resumed, straight)


def test_resume_restores_every_ranks_random_streams(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # dropout draws from the per-rank RNG: without its state the resumed run would differ
    # (scheduler=none: the budget changes between the two invocations, and a schedule would re-plan)
    args = ["+experiment=digits_cnn", "scheduler=none", "model.dropout=0.5", "checkpoint.every_n_steps=10"]
    straight, _, resumed = _resume_on_ranks(
        capfd, tmp_path, 2, [*args, "trainer.max_steps=40"], [*args, "trainer.max_steps=25"]
    )
    assert resumed.summary["resumed_from_step"] == 25
    _same_run(resumed, straight)


def test_a_restarted_run_resumes_from_its_newest_checkpoint(tmp_path: Path, straight_failing: DtfRun) -> None:
    # rank 1 dies at its 75th forward of the first attempt; the agent restarts both ranks
    restarted = run_dtf(
        [*FAILING, "+model.fail_at_call=75", "+model.first_attempt_only=true", "launcher.max_restarts=1"],
        tmp_path / "restarted",
    )
    assert restarted.summary["resumed_from_step"] == 60  # the newest checkpoint before the failure
    _same_run(restarted, straight_failing)
    # the restart is said, in one line: which rank failed and why, which attempt, where it resumes
    said = [line for line in restarted.stdout.splitlines() if line.startswith("dtf: restart")]
    assert said == [
        "dtf: restart 1 of 1 (launcher.max_restarts): rank 1 failed (RuntimeError: injected failure on rank 1); "
        "resuming from step 60"
    ], restarted.stdout[-2000:]


@pytest.mark.parametrize("how", ["agent:SIGTERM", "SIGUSR1"])
def test_a_stop_signal_saves_the_step_reached_and_the_rerun_ends_as_the_straight_run(
    tmp_path: Path, how: str, straight_failing: DtfRun
) -> None:
    # agent:SIGTERM reaches the launcher, which passes it on to the ranks; SIGUSR1 reaches rank 1 only
    stopped = run_dtf([*FAILING, "+model.fail_at_call=75", f"+model.how={how}"], tmp_path / "run", expect=EXIT_STOPPED)
    last = stopped.stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"dtf: stopped by (\S+).* at step (\d+), saved (\S+); continue with the same command .*", last)
    assert found, last
    signal_name, step, saved = found.group(1), int(found.group(2)), Path(found.group(3))
    assert signal_name == ("SIGTERM" if how == "agent:SIGTERM" else "a")  # rank 0 was not the one signalled
    assert 60 < step < N and saved == tmp_path / "run" / "checkpoints" / f"step_{step:09d}"
    assert is_complete(saved)[0] and not (tmp_path / "run" / "summary.json").exists()
    resumed = run_dtf([*FAILING, "+model.fail_rank=-1"], tmp_path / "run")
    assert resumed.summary["resumed_from_step"] == step
    _same_run(resumed, straight_failing)


def test_a_stop_signal_during_evaluation_ends_it_and_the_rerun_ends_as_the_straight_run(
    tmp_path: Path, straight_failing: DtfRun
) -> None:
    # Rank 1 sends SIGTERM to the launcher at its 2nd evaluation forward after epoch 1 (step 32);
    # every evaluation batch takes 1 s, 7 of them a rank. The ranks agree between two batches,
    # abandon the evaluation, save step 32 and stop; the rerun evaluates epoch 1 again.
    in_eval = ["+model.at_eval=true", "+model.fail_at_call=2", "+model.how=agent:SIGTERM", "+model.eval_delay_s=1.0"]
    started = time.monotonic()
    stopped = run_dtf(
        [*FAILING, *in_eval, "checkpoint.stop_check_every_n_steps=null"], tmp_path / "run", expect=EXIT_STOPPED
    )
    saved = tmp_path / "run" / "checkpoints" / f"step_{32:09d}"
    assert stopped.stderr.strip().splitlines()[-1].startswith(f"dtf: stopped by SIGTERM at step 32, saved {saved};")
    assert "epoch 1:" not in stopped.stdout  # the evaluation's line never came: it was abandoned
    assert _steps(tmp_path / "run" / "checkpoints") == [20, 32]
    assert time.monotonic() - started < 60
    resumed = run_dtf([*FAILING, "+model.fail_rank=-1"], tmp_path / "run")
    assert resumed.summary["resumed_from_step"] == 32
    _same_run(resumed, straight_failing)


def _start_slowed(run_dir: Path, err: Path, delay_s: float) -> Started:
    """FAILING (its failure off) in the background, every forward delay_s longer; stderr to err."""
    args = [*TEST_DEFAULTS, *FAILING, "+model.fail_rank=-1", f"+model.delay_s={delay_s}", f"hydra.run.dir={run_dir}"]
    return start_command(dtf_command(*args), err.with_suffix(".out"), err=err)


def test_a_second_stop_signal_kills_the_ranks_and_the_rerun_ends_as_the_straight_run(
    tmp_path: Path, straight_failing: DtfRun
) -> None:
    # SIGTERM twice to `python -m dtf`, as an impatient user or a scheduler's second notice: "now".
    run_dir = tmp_path / "run"
    with _start_slowed(run_dir, tmp_path / "err", delay_s=0.05) as proc:
        deadline = time.monotonic() + 120
        while not _steps(run_dir / "checkpoints") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.finish(EXIT_STOPPED, timeout=60)
    err_text = (tmp_path / "err").read_text()
    newest = _steps(run_dir / "checkpoints")[-1]
    assert (
        err_text.strip()
        .splitlines()[-1]
        .startswith(
            f"dtf: stopped by SIGTERM (twice) at step {newest}, saved {run_dir / 'checkpoints' / f'step_{newest:09d}'};"
        )
    ), err_text[-2000:]
    resumed = run_dtf([*FAILING, "+model.fail_rank=-1"], run_dir)
    assert resumed.summary["resumed_from_step"] == newest
    _same_run(resumed, straight_failing)


@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_rank_killed_in_a_save_is_named_and_the_rerun_ends_as_the_straight_run(
    tmp_path: Path, straight_failing: DtfRun, save: str
) -> None:
    # sync: the test kills rank 1 (SIGKILL) the moment step 40's checkpoint folder appears, while the
    # ranks write it (tens of ms here). async: rank 1 kills itself at step 45, training on while
    # step 40's checkpoint is written in the background, committed only at the exchange of step 50.
    # Either way step 40 is never committed; the rerun continues from step 20.
    run_dir = tmp_path / "run"
    if save == "async":
        async_kill = ["checkpoint.async_save=true", "+model.how=kill", "+model.fail_at_call=52"]
        err = run_dtf([*FAILING, *async_kill], run_dir, expect=1).stderr
    else:
        with _start_slowed(run_dir, tmp_path / "err", delay_s=0.02) as proc:
            from dtf.heartbeat import path_of, read

            deadline = time.monotonic() + 120
            beat = None
            while beat is None and proc.poll() is None and time.monotonic() < deadline:
                beat = read(path_of(run_dir, 1))
                time.sleep(0.05)
            step_40 = run_dir / "checkpoints" / f"step_{40:09d}"
            while not step_40.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
            assert beat is not None
            os.kill(beat.pid, signal.SIGKILL)
            proc.finish(1, timeout=120)
        err = (tmp_path / "err").read_text()
    assert err.strip().splitlines()[-1].startswith("dtf: error: rank 1 failed: killed by signal SIGKILL"), err[-2000:]
    assert _steps(run_dir / "checkpoints") == [20]
    resumed = run_dtf([*FAILING, "+model.fail_rank=-1"], run_dir)
    assert resumed.summary["resumed_from_step"] == 20
    _same_run(resumed, straight_failing)


def test_incomplete_or_truncated_checkpoints_are_skipped_never_loaded(tmp_path: Path, straight_ddp: DtfRun) -> None:
    args = [*COMMON, "checkpoint.keep_last=3"]
    straight = straight_ddp
    run_dir = tmp_path / "resumed"
    run_dtf([*args, f"trainer.max_steps={K}"], run_dir)
    ckpts = run_dir / "checkpoints"
    newest = ckpts / f"step_{K:09d}"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)  # one with tensors in it
    shard.write_bytes(shard.read_bytes()[:10])  # truncated, as by a full disk or a kill mid-copy
    (ckpts / "step_000000099").mkdir()  # a save that never committed
    # named explicitly, a bad checkpoint is an error before anything starts, not a silent fallback
    named = run_dtf([*args, f"checkpoint.resume={newest}"], tmp_path / "named", expect=2)
    assert named.stderr.strip().splitlines() == [
        f"dtf: error: checkpoint.resume={newest} is not a complete checkpoint: {shard.name} is missing or truncated"
    ]
    resumed = run_dtf([*args, f"trainer.max_steps={N}"], run_dir)
    assert f"skipping checkpoint {newest}" in resumed.stderr and "truncated" in resumed.stderr
    assert "step_000000099: no commit marker" in resumed.stderr
    assert resumed.summary["resumed_from_step"] == 40
    _same_run(resumed, straight)


def _contents(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_resume_never_starts_fresh(tmp_path: Path, straight_ddp: DtfRun) -> None:
    shutil.copytree(straight_ddp.run_dir, tmp_path / "run")  # a run's dir with its checkpoints
    # A resume after the model changed shape: one line naming the first tensor that differs and both
    # shapes, bad input (2), and the checkpoints left as they were.
    checkpoints = _contents(tmp_path / "run" / "checkpoints")
    other = run_dtf([*COMMON, f"trainer.max_steps={N}", "model.hidden=64"], tmp_path / "run", expect=2)
    newest = tmp_path / "run" / "checkpoints" / f"step_{N:09d}"
    assert other.stderr.strip().splitlines() == [
        f"dtf: error: checkpoint {newest} does not fit this run: model.net.0.weight has the shape [100, 2] there "
        "and [64, 2] here; resume with the model and optimizer it was trained with, or start over with "
        "checkpoint.resume=never (its checkpoints are moved aside) or another hydra.run.dir"
    ]
    assert _contents(tmp_path / "run" / "checkpoints") == checkpoints
    again = run_dtf([*COMMON, "trainer.max_steps=30", "checkpoint.resume=never"], tmp_path / "run")
    assert again.summary["resumed_from_step"] is None


def test_a_non_finite_loss_on_one_rank_stops_the_run_at_that_step_with_its_checkpoints_finite(tmp_path: Path) -> None:
    # rank 1's loss is NaN at step 45; on_nonfinite=stop is the default
    model = ["model._target_=user_models.NonFiniteModel", "+model.at_call=45", "+model.ranks=[1]"]
    run = run_dtf([*COMMON, *model, f"trainer.max_steps={N}"], tmp_path / "run", expect=1)
    assert run.stderr.strip().splitlines() == [
        "dtf: error: training diverged: the loss or its gradients are not finite (NaN or inf) at step 45 "
        "(trainer.on_nonfinite=stop); the run stopped there and its newest checkpoint, step_000000040, holds the "
        "last finite state: lower optimizer.lr, set trainer.grad_clip_norm, or leave such steps out with "
        "trainer.on_nonfinite=skip"
    ]
    assert not (run.run_dir / "summary.json").exists() and not (run.run_dir / "model.pt").exists()
    assert _steps(run.run_dir / "checkpoints") == [20, 40]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run.run_dir / "checkpoints" / f"step_{40:09d}", tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    tensors = [t for t in _leaves(state) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert len(tensors) >= 6 and all(torch.isfinite(t).all() for t in tensors)


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [leaf for value in obj.values() for leaf in _leaves(value)]
    if isinstance(obj, list | tuple):
        return [leaf for value in obj for leaf in _leaves(value)]
    return [obj]


def test_a_full_disk_during_a_save_is_one_line_and_the_rerun_continues(
    tmp_path: Path, straight_failing: DtfRun
) -> None:
    require_unshare("give the run dir a small tmpfs")
    # The run dir on a tmpfs of its own (in a mount namespace: no root needed, gone with the test).
    # Rank 1 fills it at its 62nd forward (step 55), so the save of step 60 finds no space; the
    # test then frees the space and runs the same command, which continues from step 40.
    disk, run_dir = tmp_path / "disk", tmp_path / "disk" / "run"
    disk.mkdir()
    dtf = shlex.join(dtf_command(*TEST_DEFAULTS, *FAILING, f"hydra.run.dir={run_dir}"))
    full = ["+model.how=fill_disk", "+model.fail_at_call=62", f"+model.fill_path={disk / 'ballast'}"]
    script = f"""
        mount -t tmpfs -o size=64m tmpfs {disk} || exit 99
        {dtf} {" ".join(map(shlex.quote, full))} >{tmp_path}/full.out 2>{tmp_path}/full.err
        echo $? >{tmp_path}/full.status
        rm {disk}/ballast
        {dtf} +model.fail_rank=-1 >{tmp_path}/rerun.out 2>{tmp_path}/rerun.err
        echo $? >{tmp_path}/rerun.status
        cp {run_dir}/summary.json {tmp_path}/summary.json
    """
    run_command(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, timeout=400)
    err = (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.status").read_text().strip() == "2", err[-3000:]
    assert err.strip().splitlines() == [
        f"dtf: error: no space left on the device of {run_dir / 'checkpoints'} while saving the checkpoint of step "
        "60 (its files were removed; of the earlier checkpoints, step_000000040 is intact and a rerun continues "
        "from it): free space there, or keep fewer (checkpoint.keep_last) or put them on a larger disk "
        "(checkpoint.dir, hydra.run.dir), then run the same command to continue"
    ]
    assert (tmp_path / "rerun.status").read_text().strip() == "0", (tmp_path / "rerun.err").read_text()[-3000:]
    resumed = DtfRun(0, (tmp_path / "rerun.out").read_text(), "", tmp_path)  # its summary.json, copied out
    assert resumed.summary["resumed_from_step"] == 40
    _same_run(resumed, straight_failing)


def test_resume_onto_another_world_size_and_strategy(tmp_path: Path, straight_ddp: DtfRun) -> None:
    straight = straight_ddp
    run_dtf([*COMMON, "strategy=fsdp", f"trainer.max_steps={K}"], tmp_path / "fsdp2")
    source = tmp_path / "fsdp2" / "checkpoints" / f"step_{K:09d}"
    # the global batch halves (1 rank x 32): the same samples are consumed, at twice the steps
    ddp1 = run_dtf(
        [*COMMON, "launcher.nproc=1", f"trainer.max_steps={N}", f"checkpoint.resume={source}"], tmp_path / "ddp1"
    )
    s = ddp1.summary
    assert (
        s["resumed_from_step"] == K
        and s["world_size"] == 1
        and s["lr_final"] == pytest.approx(straight.summary["lr_final"] / 2)
    )  # the LR follows the new world size (linear scaling)
    assert "world size changed (2 -> 1)" in ddp1.stdout
    # it continued training, not restarted: far below the untrained loss, near the straight run's
    assert s["final_test_loss"] < 2 * straight.summary["final_test_loss"]
    weights = torch.load(ddp1.run_dir / "model.pt", weights_only=True)
    from dtf.models.approximator import Approximator

    Approximator().load_state_dict(weights)  # the export is a plain state dict


def _steps(ckpts: Path) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torn checkpoints are expected here
        return sorted(int(p.name.removeprefix("step_")) for p in committed(ckpts))


@pytest.mark.slow
def test_kill_9_at_random_moments_and_during_saves_never_loses_the_newest_complete_checkpoint(
    tmp_path: Path, straight_failing: DtfRun
) -> None:
    # Each forward sleeps, so the run trains for seconds and the kills land all over it.
    args = [*FAILING, "+model.fail_rank=-1", "+model.delay_s=0.05", "checkpoint.every_n_steps=5"]
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    cmd = dtf_command(*TEST_DEFAULTS, *args, f"hydra.run.dir={run_dir}")
    rng = random.Random(20261122)
    torn = 0
    for trial in range(2):  # one kill at a random moment, one during a save
        before = _steps(ckpts)
        log = tmp_path / f"trial{trial}.log"
        # its own session: the kill takes the whole run (driver, agent and ranks), as a lost node would
        with start_command(cmd, log, new_session=True) as proc:
            deadline = time.monotonic() + 120
            while "rank(s), strategy=" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)  # set up (and resumed, if there was a checkpoint)
            if trial % 2:  # during a save: the moment a step folder without its marker appears
                while proc.poll() is None and time.monotonic() < deadline:
                    if any(not (p / MARKER).exists() for p in ckpts.glob("step_*") if int(p.name[5:]) not in before):
                        break
                    time.sleep(0.001)
            else:
                time.sleep(rng.uniform(0.0, 1.5))
            proc.kill_everything()
        after = _steps(ckpts)
        torn += any(not (p / MARKER).exists() for p in ckpts.glob("step_*"))
        # the newest complete checkpoint never goes backwards, and a resume would pick it
        assert (after or [-1])[-1] >= (before or [-1])[-1], log.read_text()[-2000:]
        if before:
            assert f"resumed from {ckpts / f'step_{before[-1]:09d}'}" in log.read_text()
    assert torn >= 1, "no kill landed during a save: the trials did not test what they claim"
    newest = _steps(ckpts)[-1]
    final = run_dtf(args, run_dir)
    assert final.summary["resumed_from_step"] == newest
    _same_run(final, straight_failing)


@pytest.mark.slow
def test_ranks_whose_driver_is_killed_stop_at_a_checkpoint_within_seconds_and_the_command_continues(
    tmp_path: Path, straight_failing: DtfRun
) -> None:
    # kill -9 of `python -m dtf` alone (the OOM killer's choice, or a user's): its ranks, in sessions
    # of their own and children of the run's forkserver, trained on with nobody to collect them.
    args = [*FAILING, "+model.fail_rank=-1", "+model.delay_s=0.05"]
    run_dir = tmp_path / "run"
    cmd = dtf_command(*TEST_DEFAULTS, *args, f"hydra.run.dir={run_dir}")
    log = tmp_path / "killed.log"
    with start_command(cmd, log, new_session=True) as proc:
        deadline = time.monotonic() + 120
        while "rank(s), strategy=" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # some steps into training (each forward sleeps 0.05 s)
        ranks = descendants(proc.pid)  # the forkserver, the ranks, their helpers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        while any(is_running(p) for p in ranks) and time.monotonic() - killed < 30:
            time.sleep(0.1)
        ended_after_s = time.monotonic() - killed
        left = [p for p in ranks if is_running(p)]
        for pid in left:  # what the test started, should it fail
            os.kill(pid, signal.SIGKILL)
    assert not left and ended_after_s < 15, (ended_after_s, left, log.read_text()[-2000:])
    assert "the driver (pid" in log.read_text() and "is gone: stopping at a checkpoint" in log.read_text()
    newest = _steps(run_dir / "checkpoints")[-1]
    assert 10 <= newest < N  # the stop's own checkpoint, not the last periodic one (every 20 steps)
    final = run_dtf(args, run_dir)
    assert final.summary["resumed_from_step"] == newest
    _same_run(final, straight_failing)


def test_zero1_resume_inside_the_warmup_ends_bit_for_bit_where_the_straight_run_ends(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # ZeroRedundancyOptimizer's local param_groups lag one scheduler step behind its own: a resume
    # that restores those would continue the warm-up from the previous step's LR, forever behind.
    args = ["strategy=zero", "strategy.stage=1", "trainer.warmup_steps=100", *COMMON[:2]]
    straight, _, resumed = _resume_on_ranks(
        capfd, tmp_path, 2, [*args, "trainer.max_steps=300"], [*args, "trainer.max_steps=50"]
    )
    assert resumed.summary["resumed_from_step"] == 50
    assert resumed.summary["lr_final"] == straight.summary["lr_final"]
    _same_run(resumed, straight)


def _scalars(run_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        values.update({e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {})
    return values


# 2,000 training samples, 32 per batch: 32 batches per epoch on 2 ranks, 63 on 1, 16 on 4.
WORLD = [
    "data.dataset.num_points=2400",
    "data.dataset.num_test=400",
    "scheduler=cosine",
    "trainer.log_every_n_steps=1",
    "checkpoint.every_n_steps=32",
    "checkpoint.keep_last=10",
    "trainer.max_epochs=4",
]
STEPS_PER_EPOCH = {1: 63, 2: 32, 4: 16}


@pytest.fixture(scope="module")
def four_epochs_on_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> DtfRun:
    # these tests' runs go through the ranks' body (the one `python -m dtf` runs) on gloo ranks they start
    root = tmp_path_factory.mktemp("world")
    train_on_ranks(2, [("run", WORLD)], root)
    return DtfRun(0, "", "", root / "run")


@pytest.mark.parametrize("nproc", [1, 4])
def test_resume_onto_another_world_size_keeps_the_budget_and_the_schedule(
    tmp_path: Path, nproc: int, four_epochs_on_two_ranks: DtfRun
) -> None:
    source = four_epochs_on_two_ranks
    checkpoint = source.run_dir / "checkpoints" / f"step_{64:09d}"  # the end of epoch 2
    s = train_on_ranks(nproc, [("run", [*WORLD, f"checkpoint.resume={checkpoint}"])], tmp_path)["run"]
    assert s["world_size"] == nproc
    # the budget is the one asked for: 4 epochs in all, the last 2 at this world size's steps per epoch
    assert s["epochs"] == 4 and len(s["train_loss_per_epoch"]) == 4 and len(s["test_loss_per_epoch"]) == 4
    assert s["global_step"] == 64 + 2 * STEPS_PER_EPOCH[nproc]
    assert s["samples_seen"] == source.summary["samples_seen"] == 4 * 2000
    # the cosine continues from where it was (rescaled for the world size, linear scaling) and ends on time
    before = _scalars(source.run_dir, "train/lr")
    after = _scalars(tmp_path / "run", "train/lr")
    per_step_change = abs(before[64] - before[65])
    assert after[65] == pytest.approx(before[64] * nproc / 2, abs=2 * per_step_change * nproc / 2)
    assert s["lr_final"] == pytest.approx(0.0, abs=1e-12) == source.summary["lr_final"]


def test_resume_with_a_larger_epoch_budget_on_one_rank_trains_exactly_the_epochs_asked_for(
    tmp_path: Path, four_epochs_on_two_ranks: DtfRun
) -> None:
    # the repro: 2 epochs on 2 ranks, then max_epochs=4 on 1 rank from its last checkpoint
    first = train_on_ranks(2, [("a", [*WORLD, "trainer.max_epochs=2"])], tmp_path)["a"]
    assert first["epochs"] == 2
    checkpoint = tmp_path / "a" / "checkpoints" / f"step_{64:09d}"
    run = train_on_ranks(1, [("b", [*WORLD, f"checkpoint.resume={checkpoint}"])], tmp_path)["b"]
    assert run["world_size"] == 1 and run["epochs"] == 4 and run["global_step"] == 64 + 2 * 63


def test_throughput_and_training_time_after_a_resume_count_each_sample_and_second_once(tmp_path: Path) -> None:
    # every forward sleeps 50 ms, so a step takes at least that: training time and rates have hard bounds
    args = [
        *FAILING[:1],
        "+model.fail_rank=-1",
        "+model.delay_s=0.05",
        *COMMON[:2],
        "trainer.log_every_n_steps=1",
        "checkpoint.every_n_steps=10",
    ]
    # on gloo ranks the test starts (the ranks' body is the one `python -m dtf` runs), the resume on fresh ranks
    train_on_ranks(2, [("run", [*args, "trainer.max_steps=20"])], tmp_path)  # stops inside epoch 1 (32 steps)
    s = train_on_ranks(2, [("run", [*args, "trainer.max_steps=40"])], tmp_path)["run"]
    assert s["resumed_from_step"] == 20 and s["samples_seen"] == 2000 + 8 * 64  # epoch 1 (32 steps), 8 steps more
    assert s["train_seconds"] >= 40 * 0.05  # the 20 steps before the resume count too
    rates = _scalars(tmp_path / "run", "train/samples_per_sec")
    assert max(v for step, v in rates.items() if step > 20) <= 64 / 0.05  # 64 samples per step, >= 50 ms each


def test_a_fresh_start_in_a_used_run_dir_moves_the_old_checkpoints_aside(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # on gloo ranks the test starts (the ranks' body is the one `python -m dtf` runs): the first
    # run and the fresh start on one start of the ranks, the default resume on fresh ranks
    run_dir = tmp_path / "run"
    capfd.readouterr()
    fresh = train_on_ranks(
        2,
        [
            ("run", [*COMMON, "trainer.max_steps=100"]),  # leaves steps 80 and 100
            ("run", [*COMMON, "trainer.max_steps=60", "checkpoint.resume=never"]),
        ],
        tmp_path,
    )["run"]  # the summary.json the fresh start wrote
    said = capfd.readouterr().out
    assert fresh["resumed_from_step"] is None and fresh["global_step"] == 60
    assert _steps(run_dir / "checkpoints") == [40, 60]  # the new run's own, not the old run's higher steps
    aside = [p for p in run_dir.iterdir() if p.name.startswith("checkpoints.")]
    assert len(aside) == 1 and _steps(aside[0]) == [80, 100], "the old run's checkpoints are kept, not deleted"
    assert f"moved to {aside[0]}" in said
    # the default (resume=auto) now continues the new run, not the old one
    again = train_on_ranks(2, [("run", [*COMMON, "trainer.max_steps=100"])], tmp_path)["run"]
    assert again["resumed_from_step"] == 60


def test_a_restarted_run_that_started_fresh_resumes_from_its_own_newest_checkpoint(
    tmp_path: Path, straight_failing: DtfRun
) -> None:
    # checkpoint.resume=never is for the first attempt: the restart after rank 1 dies continues this run
    restarted = run_dtf(
        [
            *FAILING,
            "+model.fail_at_call=75",
            "+model.first_attempt_only=true",
            "launcher.max_restarts=1",
            "checkpoint.resume=never",
        ],
        tmp_path / "restarted",
    )
    assert restarted.summary["resumed_from_step"] == 60
    _same_run(restarted, straight_failing)


def test_a_checkpoint_damaged_after_its_commit_is_never_loaded(tmp_path: Path, straight_ddp: DtfRun) -> None:
    run_dir = tmp_path / "resumed"
    run_dtf([*COMMON, f"trainer.max_steps={K}"], run_dir)
    newest = run_dir / "checkpoints" / f"step_{K:09d}"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)  # one with tensors in it
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte in the middle of the tensors: same size, new values
    shard.write_bytes(bytes(data))
    named = run_dtf([*COMMON, f"checkpoint.resume={newest}"], tmp_path / "named", expect=2)
    assert named.stderr.strip().splitlines() == [
        f"dtf: error: checkpoint.resume={newest} is not a complete checkpoint: {shard.name} is damaged (its "
        "checksum differs from the one recorded at the commit)"
    ]
    resumed = run_dtf([*COMMON, f"trainer.max_steps={N}"], run_dir)
    warned = [line for line in resumed.stderr.splitlines() if str(newest) in line]
    assert len(warned) == 1 and "damaged" in warned[0], resumed.stderr
    assert resumed.summary["resumed_from_step"] == 40  # the one before it
    _same_run(resumed, straight_ddp)
