"""StepControl: the ranks' small exchange (stop signals, background saves) happens at the same
steps on every rank, about every stop_check_every_s seconds, and a stop lands where it should."""

from __future__ import annotations

from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from dtf.train.control import StepControl
from tests.helpers.gloo import run_on_ranks


class Clock:
    """A clock that advances step_s per training step (set by the loop below)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Stop:
    def __init__(self) -> None:
        self.requested = False


def _control(world: int, clock: Clock, stop: Stop, is_main: bool = True, every_n: int | None = None) -> StepControl:
    idle_checkpointer = SimpleNamespace(
        background_step=None, background_done=lambda: True, finish=lambda: None, close=lambda: None
    )
    return StepControl(
        stop,  # type: ignore[arg-type]
        idle_checkpointer,  # type: ignore[arg-type]
        world,
        every_n_steps=every_n,
        every_s=0.25,
        is_main=is_main,
        clock=clock,
    )


def _train(control: StepControl, clock: Clock, stop: Stop, steps: int, signal_at: int | None = None) -> int | None:
    for step in range(1, steps + 1):
        clock.now += clock.step_s
        if step == signal_at:
            stop.requested = True
        if control.should_stop(step, last=step == steps):
            return step
    return None


def test_the_exchange_comes_about_every_stop_check_every_s_seconds() -> None:
    clock, stop = Clock(step_s=0.010), Stop()
    control = _control(1, clock, stop)
    _train(control, clock, stop, 200)
    # Step by step until rank 0's first measurement (10 ms a step) has come back, then every
    # 0.25 s / 10 ms = 25 steps.
    assert list(control.exchange_steps) == [1, 2, 3, 28, 53, 78, 103, 128, 153, 178]


def test_the_interval_follows_the_step_time() -> None:
    clock, stop = Clock(step_s=0.010), Stop()
    control = _control(1, clock, stop)
    _train(control, clock, stop, 53)
    clock.step_s = 0.050  # steps become 5x slower: after one exchange late, 5 steps per exchange
    for step in range(54, 120):
        clock.now += clock.step_s
        control.should_stop(step, last=False)
    gaps = [b - a for a, b in pairwise(control.exchange_steps)]
    assert gaps[-3:] == [5, 5, 5]


def test_a_stop_lands_two_exchanges_after_the_signal() -> None:
    clock, stop = Clock(step_s=0.010), Stop()
    control = _control(1, clock, stop)
    # Signalled at step 30: posted at the exchange of step 53, read at the one of step 78.
    assert _train(control, clock, stop, 200, signal_at=30) == 78
    assert control.stopped_at_step == 78


def test_a_fixed_interval_is_every_n_steps() -> None:
    clock, stop = Clock(step_s=0.010), Stop()
    control = _control(1, clock, stop, every_n=10)
    assert _train(control, clock, stop, 100, signal_at=12) == 30
    assert list(control.exchange_steps) == [10, 20, 30]


def _ranks_with_different_clocks(rank: int, world: int) -> None:
    # Rank 1 measures its steps 7 times slower than rank 0: if each rank derived the interval
    # from its own clock, they would call the collective at different steps and hang.
    clock, stop = Clock(step_s=0.010 * (7 if rank == 1 else 1)), Stop()
    control = _control(world, clock, stop, is_main=rank == 0)
    stopped = _train(control, clock, stop, 300, signal_at=100 if rank == 1 else None)
    steps: list[list[int]] = [[] for _ in range(world)]
    dist.all_gather_object(steps, list(control.exchange_steps))
    assert steps[0] == steps[1], steps
    assert steps[0][:5] == [1, 2, 3, 28, 53]  # rank 0's clock sets the pace
    assert stopped == 128  # rank 1's signal at step 100: posted at 103, agreed at 128, on both ranks
    control.close()


def test_ranks_exchange_at_the_same_steps_whatever_their_clocks() -> None:
    run_on_ranks(_ranks_with_different_clocks, 2)


def _epochs(
    control: StepControl,
    clock: Clock,
    stop: Stop,
    epochs: int,
    steps: int,
    batches: int,
    batch_s: float,
    signal_at_s: float | None = None,
) -> tuple[int, float] | None:
    """Epochs of `steps` training steps, each followed by an evaluation of `batches` batches of
    batch_s seconds (as Validator.evaluate calls the control); (step, time) of an agreed stop."""
    step = 0
    for _ in range(epochs):
        for _ in range(steps):
            step += 1
            clock.now += clock.step_s
            if signal_at_s is not None and clock.now >= signal_at_s:
                stop.requested = True
            if control.should_stop(step, last=False):
                return step, clock.now
        control.enter_phase()
        for j in range(batches):
            if j > 0 and control.should_stop_evaluating(j):
                control.enter_phase()
                return step, clock.now
            clock.now += batch_s
        control.enter_phase()
    return None


def _counting_exchanges(control: StepControl) -> list[int]:
    count = [0]
    receive = control._receive

    def counted() -> Any:
        count[0] += 1
        return receive()

    control._receive = counted  # type: ignore[method-assign]
    return count


def test_short_epochs_exchange_at_the_pace_not_at_every_switch() -> None:
    # 3 ms steps, 16 a epoch, 4 evaluation batches of 3 ms between: 20 epochs are 1.2 s of work,
    # about 5 exchanges at 0.25 s. Once each kind of work has been measured, switching between
    # them must not restart the step-by-step exchanges (3 after every switch: 120 in all).
    clock, stop = Clock(step_s=0.003), Stop()
    control = _control(1, clock, stop)
    count = _counting_exchanges(control)
    _epochs(control, clock, stop, epochs=20, steps=16, batches=4, batch_s=0.003)
    assert count[0] <= 20, count[0]


def test_a_stop_between_short_epochs_lands_within_two_intervals() -> None:
    # Evaluation batches 10x slower than steps: the interval of one kind never delays the other's.
    for signal_at_s in (0.3, 0.61, 0.9, 1.33):
        clock, stop = Clock(step_s=0.003), Stop()
        control = _control(1, clock, stop)
        stopped = _epochs(control, clock, stop, epochs=100, steps=16, batches=4, batch_s=0.03, signal_at_s=signal_at_s)
        assert stopped is not None
        assert stopped[1] - signal_at_s <= 2 * 0.25 + 0.05, (signal_at_s, stopped)
