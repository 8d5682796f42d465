"""Decisions all ranks must take at the same step: stop now (a signal reached some rank), and
commit the checkpoint being written in the background (every rank has finished its part). Both
are taken here, in one place; the loop only asks whether to stop.

At some step boundaries every rank posts its view as one small all-reduce on a dedicated gloo
group and reads the result posted at the previous such boundary, so the loop never waits for it
(the answer arrives one exchange late). The dedicated group keeps these collectives out of the
strategy's own stream of collectives, and on GPUs off NCCL.

Not every step: an exchange is a round trip between ranks and costs tens of microseconds of CPU,
which is several percent of a small model's millisecond step. By default the ranks exchange
about every `every_s` seconds of training, whatever a step takes: rank 0 measures its steps and
proposes the next interval in steps inside the exchange itself, so every rank reads the same
integer and all keep exchanging at the same steps (each rank computing an interval from its own
clock could disagree, and ranks that call a collective at different steps hang). A stop signal
then takes effect within about two intervals. `every_n_steps` fixes the interval instead.

Evaluation batches are boundaries too (every rank runs the same number of them), where a stop
abandons the evaluation. Its batches take another time than training steps: an interval proposed
for one kind of work is never used for the other. Each kind keeps its latest agreed interval, so a
switch (enter_phase) brings the next exchange no later than that interval of the new work, and
never postpones one already due. Only a kind not measured yet (the first epoch's training, the
first evaluation) exchanges at once and then step by step until rank 0's first measurement of it
has come back. (Restarting that at every switch cost 6 exchanges per epoch, 20% of a short epoch's
steps, and a fifth of the step on 2 ranks on 2 cores.)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtf.dist.env import side_group
from dtf.signals import StopRequest
from dtf.train.checkpoint import Checkpointer


@dataclass(frozen=True)
class Agreement:
    stop: bool  # some rank received a stop signal
    committed_step: int | None  # the background save of this step has finished on every rank
    next_interval: int | None = None  # steps until the next exchange, as rank 0 proposed them


# An interval in steps, proposed by rank 0, travels as a float64 sum with the other ranks' zeros:
# exact for any integer up to 2**53, so every rank reads the very same number.
MAX_INTERVAL = 1_000_000


class StepControl:
    def __init__(
        self,
        stop_request: StopRequest,
        checkpointer: Checkpointer,
        world_size: int,
        every_n_steps: int | None,
        every_s: float = 0.25,
        is_main: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.stop_request = stop_request
        self.checkpointer = checkpointer
        self.world_size = world_size
        self.every_n_steps = every_n_steps
        self.every_s = every_s
        self.is_main = is_main
        self.clock = clock
        self.group = (
            (side_group() or dist.new_group(backend="gloo")) if dist.is_initialized() and world_size > 1 else None
        )
        self._posted: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._boundaries = 0  # boundaries passed (steps and evaluation batches): equal on every rank
        self._due: int | None = None  # the boundary of the next exchange (time-based interval)
        self._entering = True  # the next boundary is a phase's first (the run's too)
        self._intervals: dict[bool, int] = {}  # the latest agreed interval for training (True), evaluation
        self._last_post: tuple[int, float] | None = None  # (boundary, clock) of this rank's latest post
        self._phase = 0  # bumped by enter_phase; the pending post's proposal is for its phase only
        self._posted_phase = 0
        # Where the latest exchanges happened (tests compare ranks), bounded for long runs.
        self.exchange_steps: deque[int] = deque(maxlen=10_000)
        self.stopped_at_step: int | None = None

    def should_stop(self, step: int, last: bool) -> bool:
        """Called by every rank at every step boundary (step: the global step, equal on all ranks;
        last: the run's final step, where there is nothing left to stop). Commits the background
        save once every rank has written its part; True when the ranks agreed to stop here."""
        agreed = self.exchange(step)
        self._commit_if_done(agreed)
        if agreed.stop and not last:
            self.stopped_at_step = step
            return True
        return False

    def should_stop_evaluating(self, batch: int) -> bool:
        """Called by every rank after each evaluation batch (batch: 1, 2, ...): True when the ranks
        agreed to stop, which abandons the evaluation there (the resumed run evaluates again)."""
        agreed = self.exchange(batch, training=False)
        self._commit_if_done(agreed)
        return agreed.stop

    def stop_at(self, step: int) -> None:
        """The ranks agreed to stop outside a step boundary (in an evaluation): the run ends at step."""
        self.stopped_at_step = step

    def enter_phase(self) -> None:
        """The work between boundaries changes (training <-> evaluation): on every rank at once."""
        self._phase += 1
        self._entering = True
        self._last_post = None

    def _commit_if_done(self, agreed: Agreement) -> None:
        ck = self.checkpointer
        if agreed.committed_step is not None and agreed.committed_step == ck.background_step:
            ck.finish()  # every rank has written its part: commits without waiting for anything

    def _due_now(self, index: int, training: bool) -> bool:
        self._boundaries += 1
        if self.every_n_steps is not None:
            return index % self.every_n_steps == 0
        if self._entering:
            self._entering = False
            known = self._intervals.get(training)
            if known is None or self._due is None:  # work not measured yet: exchange at once
                self._due = self._boundaries
            else:
                self._due = min(self._due, self._boundaries - 1 + known)
        assert self._due is not None
        return self._boundaries >= self._due

    def exchange(self, index: int, training: bool = True) -> Agreement:
        """Posts this rank's view when an exchange is due and returns the agreement posted the
        time before (all ranks call it at the same boundaries). index: the step, or the
        evaluation batch's number (the fixed interval counts in them)."""
        if not self._due_now(index, training):
            return Agreement(stop=False, committed_step=None)
        if training:
            self.exchange_steps.append(index)
        previous = self._receive()
        if previous.next_interval and self._posted_phase == self._phase:  # measured on this phase's work
            self._intervals[training] = previous.next_interval
        # Until rank 0's first measured proposal for this kind of work has come back, the
        # exchanges follow step by step.
        self._due = self._boundaries + self._intervals.get(training, 1)
        writing, done = self.checkpointer.background_step, self.checkpointer.background_done()
        view = torch.tensor(
            [
                1.0 if self.stop_request.requested else 0.0,
                0.0 if writing is None or done else 1.0,  # ranks still writing
                -1.0 if writing is None else float(writing),
                float(self._propose(self._boundaries)) if self.is_main and self.every_n_steps is None else 0.0,
            ],
            dtype=torch.float64,
        )
        if self.group is not None:
            self._work = dist.all_reduce(view, group=self.group, async_op=True)
        self._posted = view
        self._posted_phase = self._phase
        return previous

    def _propose(self, boundary: int) -> int:
        """Rank 0's interval for the ranks to use: boundaries that take about every_s seconds, from
        the mean time per boundary since its previous post in this phase (0: nothing measured yet)."""
        now, last = self.clock(), self._last_post
        self._last_post = (boundary, now)
        if last is None or boundary <= last[0]:
            return 0
        step_s = (now - last[1]) / (boundary - last[0])
        return max(1, min(MAX_INTERVAL, round(self.every_s / step_s))) if step_s > 0 else MAX_INTERVAL

    def _receive(self) -> Agreement:
        if self._posted is None:
            return Agreement(stop=False, committed_step=None)
        if self._work is not None:
            self._work.wait()
        stop, writing, step_sum, interval = self._posted.tolist()
        # The same save on every rank (saves start at the same boundary everywhere), finished by all.
        step = step_sum / self.world_size
        committed = int(step) if step >= 0 and step.is_integer() and writing == 0 else None
        return Agreement(stop=stop > 0, committed_step=committed, next_interval=int(interval) or None)

    def close(self) -> None:
        """Commits the last background save (and ends the checkpoint writer process) and waits for
        the last posted exchange, so that nothing is left in flight."""
        self.checkpointer.close()
        if self._work is not None:
            self._work.wait()
            self._work = None
