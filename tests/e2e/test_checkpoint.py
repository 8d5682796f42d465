"""Interrupted and resumed runs end exactly where uninterrupted ones end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import DtfRun, run_dtf

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
    "zero1": ["strategy=zero", "strategy.stage=1"],
    "zero2": ["strategy=zero", "strategy.stage=2"],
    "zero3": ["strategy=zero", "strategy.stage=3"],
    "fsdp": ["strategy=fsdp"],
    "mics": ["strategy=mics", "strategy.partition_group_size=2", "launcher.nproc=4"],
}


@pytest.fixture(scope="module")
def straight_ddp(tmp_path_factory: pytest.TempPathFactory) -> DtfRun:
    """The uninterrupted reference run of COMMON (DDP on 2 ranks, N steps)."""
    return _ok(run_dtf([*COMMON, f"trainer.max_steps={N}"], tmp_path_factory.mktemp("straight") / "run"))


def _ok(run: DtfRun) -> DtfRun:
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _same_run(a: DtfRun, b: DtfRun) -> None:
    sa, sb = a.summary, b.summary
    assert sa["params_sha256"] == sb["params_sha256"]
    assert sa["train_loss_per_epoch"] == sb["train_loss_per_epoch"]
    assert sa["test_loss_per_epoch"] == sb["test_loss_per_epoch"]
    assert sa["global_step"] == sb["global_step"]


@pytest.mark.parametrize(
    "name",
    [
        "ddp",
        "zero1",
        "fsdp",
        pytest.param("zero2", marks=pytest.mark.slow),
        pytest.param("zero3", marks=pytest.mark.slow),
        pytest.param("mics", marks=pytest.mark.slow),
    ],
)
def test_resume_mid_epoch_ends_bit_for_bit_where_the_straight_run_ends(
    tmp_path: Path, name: str, straight_ddp: DtfRun
) -> None:
    args = [*COMMON, *STRATEGIES[name]]
    straight = straight_ddp if name == "ddp" else _ok(run_dtf([*args, f"trainer.max_steps={N}"], tmp_path / "straight"))
    first = _ok(run_dtf([*args, f"trainer.max_steps={K}"], tmp_path / "resumed"))
    assert first.summary["resumed_from_step"] is None
    resumed = _ok(run_dtf([*args, f"trainer.max_steps={N}"], tmp_path / "resumed"))
    assert resumed.summary["resumed_from_step"] == K
    assert f"resumed from {tmp_path / 'resumed' / 'checkpoints' / f'step_{K:09d}'}" in resumed.stdout
    _same_run(resumed, straight)


def test_resume_restores_every_ranks_random_streams(tmp_path: Path) -> None:
    # dropout draws from the per-rank RNG: without its state the resumed run would differ
    args = ["+experiment=digits_cnn", "model.dropout=0.5", "checkpoint.every_n_steps=10"]
    straight = _ok(run_dtf([*args, "trainer.max_steps=40"], tmp_path / "straight"))
    _ok(run_dtf([*args, "trainer.max_steps=25"], tmp_path / "resumed"))
    resumed = _ok(run_dtf([*args, "trainer.max_steps=40"], tmp_path / "resumed"))
    assert resumed.summary["resumed_from_step"] == 25
    _same_run(resumed, straight)


def test_a_restarted_run_resumes_from_its_newest_checkpoint(tmp_path: Path) -> None:
    model = ["model._target_=user_models.FailingModel", *COMMON, f"trainer.max_steps={N}"]
    clean = _ok(run_dtf([*model, "+model.fail_rank=-1"], tmp_path / "clean"))
    # rank 1 dies at its 75th forward of the first attempt; the agent restarts both ranks
    restarted = _ok(
        run_dtf(
            [*model, "+model.fail_at_call=75", "+model.first_attempt_only=true", "launcher.max_restarts=1"],
            tmp_path / "restarted",
        )
    )
    assert restarted.summary["resumed_from_step"] == 60  # the newest checkpoint before the failure
    _same_run(restarted, clean)


def test_incomplete_or_truncated_checkpoints_are_skipped_never_loaded(tmp_path: Path, straight_ddp: DtfRun) -> None:
    args = [*COMMON, "checkpoint.keep_last=3"]
    straight = straight_ddp
    run_dir = tmp_path / "resumed"
    _ok(run_dtf([*args, f"trainer.max_steps={K}"], run_dir))
    ckpts = run_dir / "checkpoints"
    newest = ckpts / f"step_{K:09d}"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])  # truncated, as by a full disk or a kill mid-copy
    (ckpts / "step_000000099").mkdir()  # a save that never committed
    # named explicitly, a bad checkpoint is an error before anything starts, not a silent fallback
    named = run_dtf([*args, f"checkpoint.resume={newest}"], tmp_path / "named")
    assert named.returncode == 2
    assert named.stderr.strip().splitlines() == [
        f"dtf: error: checkpoint.resume={newest} is not a complete checkpoint: {shard.name} is missing or truncated"
    ]
    resumed = _ok(run_dtf([*args, f"trainer.max_steps={N}"], run_dir))
    assert f"skipping checkpoint {newest}" in resumed.stderr and "truncated" in resumed.stderr
    assert "step_000000099: no commit marker" in resumed.stderr
    assert resumed.summary["resumed_from_step"] == 40
    _same_run(resumed, straight)


def test_resume_never_starts_fresh(tmp_path: Path) -> None:
    _ok(run_dtf([*COMMON, "trainer.max_steps=30"], tmp_path / "run"))
    again = _ok(run_dtf([*COMMON, "trainer.max_steps=30", "checkpoint.resume=never"], tmp_path / "run"))
    assert again.summary["resumed_from_step"] is None


def test_resume_onto_another_world_size_and_strategy(tmp_path: Path, straight_ddp: DtfRun) -> None:
    straight = straight_ddp
    _ok(run_dtf([*COMMON, "strategy=fsdp", f"trainer.max_steps={K}"], tmp_path / "fsdp2"))
    source = tmp_path / "fsdp2" / "checkpoints" / f"step_{K:09d}"
    # the global batch halves (1 rank x 32): the same samples are consumed, at twice the steps
    ddp1 = _ok(
        run_dtf(
            [*COMMON, "launcher.nproc=1", f"trainer.max_steps={N}", f"checkpoint.resume={source}"], tmp_path / "ddp1"
        )
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
