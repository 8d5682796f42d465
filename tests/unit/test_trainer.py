"""The training loop's own logic, in process on one rank: budgets, positions, resume at every
point of an epoch, accumulation windows, evaluation weights, LR scaling. Each case is checked
against an uninterrupted run or a direct computation, in a second or so."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from dtf.results import Stopped
from dtf.signals import StopRequest
from tests.helpers.inprocess import train_in_process

# 2,000 training samples: 63 batches of 32 per epoch on one rank (the last one of 16).
SMALL = ["data.dataset.num_points=2400", "data.dataset.num_test=400", "checkpoint.every_n_steps=null"]


def _run(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    summary = train_in_process([*SMALL, *args], tmp_path / name)
    assert summary is not None
    return summary


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("params_sha256", "global_step", "epochs", "train_loss_per_epoch", "test_loss_per_epoch", "lr_final"):
        assert a[key] == b[key], key


@pytest.mark.parametrize("steps", [45, 63, 126])  # mid-epoch, the last batch of an epoch, the end of epoch 2
def test_a_finished_run_run_again_ends_where_it_ended(tmp_path: Path, steps: int) -> None:
    first = _run(tmp_path, "run", f"trainer.max_steps={steps}")
    written = (tmp_path / "run" / "summary.json").read_bytes()
    again = _run(tmp_path, "run", f"trainer.max_steps={steps}")
    assert again == first and (tmp_path / "run" / "summary.json").read_bytes() == written  # its record, untouched
    if steps == 45:
        longer = _run(tmp_path, "run", f"trainer.max_steps={steps + 5}")  # a larger budget trains on
        assert longer["resumed_from_step"] == steps and longer["global_step"] == steps + 5


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("stop_at", [1, 20, 21, 42])  # in epoch 1, at its last step, in epoch 2 (accum 1: 63/epoch)
def test_resume_at_every_position_ends_where_the_straight_run_ends(tmp_path: Path, accum: int, stop_at: int) -> None:
    args = [f"trainer.grad_accum_steps={accum}", "scheduler=step", "scheduler.step_size=7", "trainer.warmup_steps=5"]
    straight = _run(tmp_path, "straight", *args, "trainer.max_epochs=3")
    _run(tmp_path, "resumed", *args, f"trainer.max_steps={stop_at}")
    resumed = _run(tmp_path, "resumed", *args, "trainer.max_epochs=3")
    assert resumed["resumed_from_step"] == stop_at
    _same(resumed, straight)
    assert resumed["samples_seen"] == straight["samples_seen"] == 3 * 2000


class StopAtCheck(StopRequest):
    """A stop signal that arrives just before the n-th time the ranks compare notes (0: before training)."""

    def __init__(self, n: int) -> None:
        super().__init__(())
        self.checks_left = n

    @property
    def requested(self) -> bool:
        if self.checks_left == 0:
            self.signal_name = "SIGTERM"
        self.checks_left -= 1
        return self.signal_name is not None


# accum 1: 63 steps per epoch; accum 3: 21. The first possible stop, mid-epoch, an epoch's last
# step, the first step of the next epoch.
@pytest.mark.parametrize(("accum", "stop_at"), [(1, 2), (1, 30), (1, 63), (1, 64), (3, 2), (3, 21), (3, 22), (3, 50)])
def test_a_stop_at_any_step_saves_there_and_the_rerun_ends_where_the_straight_run_ends(
    tmp_path: Path, accum: int, stop_at: int
) -> None:
    # The ranks compare notes after every step (check k after step k + 1) and act on what they
    # posted one exchange before: a signal that arrives before check k stops the run at step k + 2.
    # (Evaluation only after the last epoch: its batches would be checks too.)
    signal_at = stop_at - 2
    args = [
        f"trainer.grad_accum_steps={accum}",
        "trainer.max_epochs=3",
        "checkpoint.stop_check_every_n_steps=1",
        "trainer.eval_every_n_epochs=3",
    ]
    straight = _run(tmp_path, "straight", *args)
    stopped = train_in_process([*SMALL, *args], tmp_path / "stopped", StopAtCheck(signal_at))
    assert isinstance(stopped, Stopped), stopped
    assert (stopped.signal, stopped.step) == ("SIGTERM", stop_at)
    assert stopped.checkpoint == str(tmp_path / "stopped" / "checkpoints" / f"step_{stop_at:09d}")
    assert (Path(stopped.checkpoint) / "COMMITTED.json").is_file()
    assert not (tmp_path / "stopped" / "summary.json").exists()  # the run is not finished
    resumed = _run(tmp_path, "stopped", *args)
    assert resumed["resumed_from_step"] == stop_at
    _same(resumed, straight)
    assert resumed["samples_seen"] == straight["samples_seen"] == 3 * 2000


@pytest.mark.parametrize(
    ("max_steps", "signal_at", "stop_at"),
    [
        (66, 62, 63),  # read at the first check in epoch 1's evaluation (after its first batch)
        (30, 28, 30),  # read at the last step, where there is no step left to stop: the final evaluation stops
    ],
)
def test_a_stop_during_an_evaluation_abandons_it_and_the_rerun_ends_where_the_straight_run_ends(
    tmp_path: Path, max_steps: int, signal_at: int, stop_at: int
) -> None:
    # checks after every step and every evaluation batch: check 62 comes after step 63, check 63
    # after epoch 1's first evaluation batch (abandoned there, epoch 1 ended by the rerun). The
    # model draws random numbers in evaluation, and its dropout in training after it.
    args = [
        f"trainer.max_steps={max_steps}",
        "checkpoint.stop_check_every_n_steps=1",
        "model._target_=user_models.RandomInEvaluation",
    ]
    straight = _run(tmp_path, "straight", *args)
    stopped = train_in_process([*SMALL, *args], tmp_path / "stopped", StopAtCheck(signal_at))
    assert isinstance(stopped, Stopped) and stopped.step == stop_at, stopped
    resumed = _run(tmp_path, "stopped", *args)
    assert resumed["resumed_from_step"] == stop_at
    _same(resumed, straight)


def _masked_step(model: torch.nn.Module, batch: Any, loss_fn: Any) -> tuple[torch.Tensor, int]:
    """Only samples with x > 0 count: the loss is their mean and the count is how many there are."""
    x, y = batch
    keep = x[:, 0] > 0
    return loss_fn(model(x[keep]), y[keep]), int(keep.sum())


def test_evaluation_weighs_batches_by_the_count_a_step_function_returns(tmp_path: Path) -> None:
    s = _run(
        tmp_path,
        "run",
        "trainer.max_steps=5",
        "+trainer.step_fn._target_=tests.unit.test_trainer._masked_step",
        "+trainer.step_fn._partial_=true",
    )
    from dtf.data.datasets import scalar_field
    from dtf.models.approximator import Approximator

    model = Approximator()
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True))
    _, test = scalar_field(num_points=2400, num_test=400)
    x, y = test.tensors
    keep = x[:, 0] > 0
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model(x[keep]), y[keep]).item()
    assert s["final_test_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(("mode", "factor"), [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_lr_scaling_follows_the_global_batch_including_accumulation(tmp_path: Path, mode: str, factor: float) -> None:
    # one rank, 4 micro-batches per step: the global batch is 4 x data.batch_size (Goyal et al.)
    s = _run(
        tmp_path,
        mode,
        "trainer.max_steps=2",
        "trainer.grad_accum_steps=4",
        f"trainer.lr_scaling={mode}",
        "optimizer.lr=0.001",
    )
    assert s["lr_final"] == pytest.approx(0.001 * factor)


class Sample(NamedTuple):
    inputs: torch.Tensor
    target: torch.Tensor


class NamedSamples(torch.utils.data.Dataset):
    """A user's dataset whose samples are namedtuples (the DataLoader collates them into one)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Sample:
        return Sample(self.x[i], self.y[i])


def named_samples(**kwargs: Any) -> tuple[NamedSamples, NamedSamples]:
    from dtf.data.datasets import scalar_field

    train, test = scalar_field(**kwargs)
    return NamedSamples(*train.tensors), NamedSamples(*test.tensors)


def test_namedtuple_batches_train_and_evaluate_like_tuples(tmp_path: Path) -> None:
    args = ["trainer.max_steps=20"]
    plain = _run(tmp_path, "plain", *args)
    named = _run(tmp_path, "named", *args, "data.dataset._target_=tests.unit.test_trainer.named_samples")
    assert named["params_sha256"] == plain["params_sha256"]
    assert named["final_test_loss"] == plain["final_test_loss"]


def test_batches_keep_their_container_types_when_moved_or_cut() -> None:
    from dtf.data.batch import take_first, to_device

    batch = {"pair": Sample(torch.ones(4, 2), torch.arange(4)), "list": [torch.zeros(4)], "name": "b"}
    moved = to_device(batch, torch.device("meta"))  # any device but the CPU takes the moving path
    assert isinstance(moved["pair"], Sample) and moved["pair"].inputs.is_meta and moved["name"] == "b"
    cut = take_first(batch, 3)
    assert isinstance(cut["pair"], Sample) and cut["pair"].target.tolist() == [0, 1, 2]
    assert isinstance(cut["list"], list) and cut["list"][0].shape == (3,)


def test_the_summary_names_every_key_even_without_an_export(tmp_path: Path) -> None:
    s = _run(tmp_path, "run", "trainer.max_steps=2", "trainer.export_weights=false")
    assert "weights_file" in s and s["weights_file"] is None
    assert not (tmp_path / "run" / "model.pt").exists()
    with_export = _run(tmp_path, "run2", "trainer.max_steps=2")
    assert with_export["weights_file"] == "model.pt"
