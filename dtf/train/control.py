"""Decisions all ranks must take at the same step: stop now (a signal reached some rank), and
commit the checkpoint being written in the background (every rank has finished its part). Both
are taken here, in one place; the loop only asks whether to stop.

Every `every_n_steps`-th step boundary posts this rank's view as one small all-reduce on a
dedicated gloo group and reads the result posted at the previous such boundary, so the loop
never waits for it (the answer arrives one exchange late). The dedicated group keeps these
collectives out of the strategy's own stream of collectives, and on GPUs off NCCL. Not every
step: each exchange is a round trip between ranks, and a small model's step takes milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtf.train.checkpoint import Checkpointer
from dtf.train.stop import StopRequest


@dataclass(frozen=True)
class Agreement:
    stop: bool  # some rank received a stop signal
    committed_step: int | None  # the background save of this step has finished on every rank


class StepControl:
    def __init__(
        self, stop_request: StopRequest, checkpointer: Checkpointer, world_size: int, every_n_steps: int
    ) -> None:
        self.stop_request = stop_request
        self.checkpointer = checkpointer
        self.world_size = world_size
        self.every_n_steps = every_n_steps
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() and world_size > 1 else None
        self._posted: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self.stopped_at_step: int | None = None

    def should_stop(self, step: int, last: bool) -> bool:
        """Called by every rank at every step boundary (step: the global step, equal on all ranks;
        last: the run's final step, where there is nothing left to stop). Commits the background
        save once every rank has written its part; True when the ranks agreed to stop here."""
        agreed = self.exchange(step)
        ck = self.checkpointer
        if agreed.committed_step is not None and agreed.committed_step == ck.background_step:
            ck.finish()  # every rank has written its part: commits without waiting for anything
        if agreed.stop and not last:
            self.stopped_at_step = step
            return True
        return False

    def exchange(self, step: int) -> Agreement:
        """Posts this rank's view every every_n_steps steps and returns the agreement posted the
        time before (all ranks call it at the same steps)."""
        if step % self.every_n_steps:
            return Agreement(stop=False, committed_step=None)
        previous = self._receive()
        writing, done = self.checkpointer.background_step, self.checkpointer.background_done()
        view = torch.tensor(
            [
                1.0 if self.stop_request.requested else 0.0,
                0.0 if writing is None or done else 1.0,  # ranks still writing
                -1.0 if writing is None else float(writing),
            ],
            dtype=torch.float64,
        )
        if self.group is not None:
            self._work = dist.all_reduce(view, group=self.group, async_op=True)
        self._posted = view
        return previous

    def _receive(self) -> Agreement:
        if self._posted is None:
            return Agreement(stop=False, committed_step=None)
        if self._work is not None:
            self._work.wait()
        stop, writing, step_sum = self._posted.tolist()
        # The same save on every rank (saves start at the same boundary everywhere), finished by all.
        step = step_sum / self.world_size
        committed = int(step) if step >= 0 and step.is_integer() and writing == 0 else None
        return Agreement(stop=stop > 0, committed_step=committed)

    def close(self) -> None:
        """Commits the last background save and waits for the last posted exchange, so that
        nothing is left in flight."""
        self.checkpointer.finish()
        if self._work is not None:
            self._work.wait()
            self._work = None
