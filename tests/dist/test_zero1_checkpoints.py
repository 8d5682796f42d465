"""A ZeRO-1 checkpoint is DDP's checkpoint: resumed onto another world size or strategy (and a
DDP checkpoint resumed with ZeRO-1), a run continues as the same resume done with DDP alone.
(tests/unit/test_zero1.py checks the loaded state itself, element for element.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import DtfRun, run_dtf

# Adam (state to reshard), a warm-up then a step schedule (LR settings), stopped mid-epoch.
COMMON = [
    "data.dataset.num_points=2400",
    "data.dataset.num_test=400",
    "scheduler=step",
    "scheduler.step_size=15",
    "trainer.warmup_steps=5",
]
K, N = 20, 40
STRATEGIES = {"zero1": ["strategy=zero", "strategy.stage=1"], "ddp": ["strategy=ddp"], "fsdp": ["strategy=fsdp"]}
SAVE = {"zero1": ["checkpoint.async_save=true"], "ddp": []}  # zero1's state is staged, then written by a thread


def _ok(run: DtfRun) -> DtfRun:
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The checkpoint at step K of a 2-rank run, by strategy."""
    root = tmp_path_factory.mktemp("saved")
    paths = {}
    for name in ("zero1", "ddp"):
        args = STRATEGIES[name]
        run = _ok(
            run_dtf([*COMMON, *args, *SAVE[name], f"trainer.max_steps={K}", f"checkpoint.every_n_steps={K}"], root / name)
        )
        paths[name] = run.run_dir / "checkpoints" / f"step_{K:09d}"
    return paths


def _resume(tmp_path: Path, tag: str, checkpoint: Path, strategy: str, world: int) -> DtfRun:
    run = _ok(
        run_dtf(
            [
                *COMMON,
                *STRATEGIES[strategy],
                f"launcher.nproc={world}",
                f"trainer.max_steps={N}",
                f"checkpoint.resume={checkpoint}",
            ],
            tmp_path / tag,
        )
    )
    assert run.summary["resumed_from_step"] == K and run.summary["global_step"] == N
    return run


@pytest.fixture(scope="module")
def ddp_resumed(tmp_path_factory: pytest.TempPathFactory, saved: dict[str, Path]) -> dict[int, DtfRun]:
    """The reference, by world size: DDP's checkpoint resumed by DDP (made once, when first asked)."""
    root = tmp_path_factory.mktemp("ddp_resumed")

    class Runs(dict[int, DtfRun]):
        def __missing__(self, world: int) -> DtfRun:
            self[world] = _resume(root, f"ddp{world}", saved["ddp"], "ddp", world)
            return self[world]

    return Runs()


@pytest.mark.parametrize(
    ("saved_by", "resumed_by", "world"),
    [("zero1", "ddp", 1), ("zero1", "zero1", 4), ("ddp", "zero1", 2), ("zero1", "fsdp", 2)],
)
def test_a_resharded_resume_continues_as_ddps_does(
    tmp_path: Path,
    saved: dict[str, Path],
    ddp_resumed: dict[int, DtfRun],
    saved_by: str,
    resumed_by: str,
    world: int,
) -> None:
    ours = _resume(tmp_path, "ours", saved[saved_by], resumed_by, world)
    ddp = ddp_resumed[world]
    a, b = ours.summary, ddp.summary
    assert a["train_loss_per_epoch"] == pytest.approx(b["train_loss_per_epoch"], rel=1e-5)
    assert a["test_loss_per_epoch"] == pytest.approx(b["test_loss_per_epoch"], rel=1e-5)
    assert a["lr_final"] == pytest.approx(b["lr_final"], rel=1e-12)
    assert a["params_sha256_consistent"]
    theirs = torch.load(ddp.run_dir / "model.pt", weights_only=True)
    for k, v in torch.load(ours.run_dir / "model.pt", weights_only=True).items():
        torch.testing.assert_close(v, theirs[k], rtol=1e-5, atol=1e-6)
