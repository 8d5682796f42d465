"""trainer.on_nonfinite on a GPU's path, run here on the CPU: where the optimizer can leave a step
out on the device (a fused optimizer's found_inf), the step's flag goes to the optimizer and is read
one step later, so the host never waits for the device's latest work. The runs must end exactly as
the flag read at once ends them: the same parameters, losses, skips, stop line and checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dtf.errors import TrainingFailed
from dtf.train import nonfinite
from dtf.train.checkpoint import committed
from tests.helpers.inprocess import train_in_process

BASE = [
    "model._target_=user_models.NonFiniteModel",
    "+model.at_call=5",
    "optimizer=sgd",
    "optimizer.lr=0.05",
    "+optimizer.fused=true",  # takes found_inf: leaves a step out on the device
    "data.dataset.num_points=2400",
    "data.dataset.num_test=400",
    "trainer.max_steps=8",
    "checkpoint.every_n_steps=2",
]


FINITE = nonfinite.Pending.finite


def _train(tmp_path: Path, name: str, deferred: bool, monkeypatch: pytest.MonkeyPatch, *args: str) -> list[int]:
    """Trains; returns the steps whose verdicts were read deferred, in the order they were read."""
    monkeypatch.setattr(nonfinite.NonFiniteGuard, "DEFER_ON_CPU", deferred)
    reads: list[int] = []

    def counted(pending: nonfinite.Pending) -> bool:
        reads.append(pending.step)
        return FINITE(pending)

    monkeypatch.setattr(nonfinite.Pending, "finite", counted)
    try:
        train_in_process([*BASE, *args], tmp_path / name)
    except TrainingFailed as e:
        (tmp_path / name / "failed.txt").write_text(str(e))
    return reads


# What a run's time, memory or place decides, not its training.
MEASURED = {"run_dir", "peak_rss_bytes", "train_seconds", "samples_per_sec", "step_time_s", "first_step_s"}


def _outcome(run_dir: Path) -> dict[str, Any]:
    failed = run_dir / "failed.txt"
    summary = run_dir / "summary.json"
    record = json.loads(summary.read_text()) if summary.exists() else {}
    return {
        "failed": failed.read_text() if failed.exists() else None,
        "summary": {k: v for k, v in record.items() if k not in MEASURED and "blocked" not in k},
        "checkpoints": [p.name for p in committed(run_dir / "checkpoints")],
    }


@pytest.mark.parametrize(
    ("how", "mode"),
    [("nan_grad", "skip"), ("inf_loss", "skip"), ("nan_loss", "stop"), ("zero_grad", "stop")],
)
def test_a_verdict_read_a_step_later_ends_the_run_as_one_read_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, mode: str
) -> None:
    args = [f"+model.how={how}", f"trainer.on_nonfinite={mode}"]
    at_once = _train(tmp_path, "at_once", False, monkeypatch, *args)
    deferred = _train(tmp_path, "deferred", True, monkeypatch, *args)
    assert at_once == []
    # Each step's verdict read once, in order: the newest a step later, all before a save (every 2 steps).
    last = 5 if mode == "stop" and how == "nan_loss" else 8
    assert deferred == list(range(1, last + 1))
    a, d = _outcome(tmp_path / "at_once"), _outcome(tmp_path / "deferred")
    assert d == a  # summary.json but for times (parameters, losses, skips), or the same stop line
    if how == "nan_loss":
        assert d["failed"].startswith(
            "training diverged: the loss or its gradients are not finite (NaN or inf) at step 5"
        )
        assert d["checkpoints"] == ["step_000000004", "step_000000002"]
    elif how != "zero_grad":
        assert d["summary"]["nonfinite_steps_skipped"] == 1


def test_only_an_optimizer_that_skips_on_the_device_defers(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtf.config.schema import NonFinite
    from dtf.dist.env import DistEnv
    from dtf.train.precision import Precision

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    params = [torch.nn.Parameter(torch.ones(2))]
    strategy: Any = SimpleNamespace(replicated_gradients=True)  # all the guard asks of a strategy
    precision = Precision("32", env.device)

    def defers(optimizer: Any, mode: NonFinite = NonFinite.stop, prec: Precision = precision) -> bool:
        return nonfinite.NonFiniteGuard(mode, strategy, prec, env, optimizer).defers

    fused = torch.optim.SGD(params, lr=0.1, fused=True)
    assert not defers(fused)  # on the CPU reading the flag costs nothing: read at once
    monkeypatch.setattr(nonfinite.NonFiniteGuard, "DEFER_ON_CPU", True)
    assert defers(fused) and defers(torch.optim.Adam(params, fused=True))
    assert not defers(torch.optim.SGD(params, lr=0.1))  # no found_inf: the flag is read before the step
    assert not defers(fused, NonFinite.ignore)
    scaler = torch.amp.GradScaler("cpu")
    assert not defers(fused, prec=Precision("fp16-mixed", env.device, scaler))  # the scaler reads its own flag
