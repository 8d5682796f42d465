"""A ZeRO-1 checkpoint is DDP's checkpoint: resumed onto another world size or strategy (and a
DDP checkpoint resumed with ZeRO-1), a run continues as the same resume done with DDP alone.
(tests/unit/test_zero1.py checks the loaded state itself, element for element.)

The runs go through the ranks' own body (dtf.train.loop.run) on gloo ranks the test starts
(tests.helpers.inprocess.train_on_ranks), ~1 s a run instead of ~10 s through `python -m dtf`:
the saves on one start of 2 ranks, each world size's resumes on ranks started after them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.inprocess import train_on_ranks

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


# ZeRO-1 onto 2 ranks of ZeRO-1 from 4 and back is tests/unit/test_zero1.py's (the loaded state, element for element).
CASES = [("zero1", "ddp", 1), ("ddp", "zero1", 2), ("zero1", "fsdp", 2)]


@dataclass
class Run:
    summary: dict[str, Any]
    run_dir: Path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The checkpoint at step K of a 2-rank run, by strategy."""
    root = tmp_path_factory.mktemp("saved")
    runs = [
        (name, [*COMMON, *STRATEGIES[name], *SAVE[name], f"trainer.max_steps={K}", f"checkpoint.every_n_steps={K}"])
        for name in ("zero1", "ddp")
    ]
    train_on_ranks(2, runs, root)
    return {name: root / name / "checkpoints" / f"step_{K:09d}" for name, _ in runs}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory, saved: dict[str, Path]) -> dict[tuple[str, str, int], Run]:
    """(saved by, resumed by, world size) -> that resume; ("ddp", "ddp", world) is the reference.
    A world size's resumes run together, on ranks started (after the saves) the first time one
    of them is asked for."""
    root = tmp_path_factory.mktemp("resumed")

    class Runs(dict[tuple[str, str, int], Run]):
        def __missing__(self, key: tuple[str, str, int]) -> Run:
            world = key[2]
            cases = [("ddp", "ddp", world), *[c for c in CASES if c[2] == world]]
            runs = [
                (
                    f"{saved_by}-{resumed_by}-{world}",
                    [
                        *COMMON,
                        *STRATEGIES[resumed_by],
                        f"trainer.max_steps={N}",
                        f"checkpoint.resume={saved[saved_by]}",
                    ],
                )
                for saved_by, resumed_by, world in cases
            ]
            summaries = train_on_ranks(world, runs, root)
            for case, (name, _) in zip(cases, runs, strict=True):
                self[case] = Run(summaries[name], root / name)
                assert self[case].summary["resumed_from_step"] == K and self[case].summary["global_step"] == N
                assert self[case].summary["world_size"] == world
            return self[key]

    return Runs()


@pytest.mark.parametrize(("saved_by", "resumed_by", "world"), CASES)
def test_a_resharded_resume_continues_as_ddps_does(
    resumed: dict[tuple[str, str, int], Run], saved_by: str, resumed_by: str, world: int
) -> None:
    ours, ddp = resumed[saved_by, resumed_by, world], resumed["ddp", "ddp", world]
    a, b = ours.summary, ddp.summary
    assert a["train_loss_per_epoch"] == pytest.approx(b["train_loss_per_epoch"], rel=1e-5)
    assert a["test_loss_per_epoch"] == pytest.approx(b["test_loss_per_epoch"], rel=1e-5)
    assert a["lr_final"] == pytest.approx(b["lr_final"], rel=1e-12)
    assert a["params_sha256_consistent"]
    theirs = torch.load(ddp.run_dir / "model.pt", weights_only=True)
    for k, v in torch.load(ours.run_dir / "model.pt", weights_only=True).items():
        torch.testing.assert_close(v, theirs[k], rtol=1e-5, atol=1e-6)
