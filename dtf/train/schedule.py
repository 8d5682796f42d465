"""Learning-rate scaling with the global batch, warm-up, the user's scheduler, and the clock that
steps it across resumes."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR


def lr_scale_factor(mode: str, world_size: float, grad_accum_steps: int = 1) -> float:
    """Goyal et al. / Horovod: grow the LR with the global batch (linear), or its square root. The
    global batch grows with the ranks and with the micro-batches accumulated into one step."""
    growth = world_size * grad_accum_steps
    return {"none": 1.0, "linear": float(growth), "sqrt": math.sqrt(growth)}[mode]


def scale_lr(optimizer: Optimizer, factor: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] *= factor


def build_scheduler(
    optimizer: Optimizer,
    factory: Callable[..., LRScheduler] | None,
    total_steps: int,
    warmup_steps: int,
    warmup_start_factor: float,
) -> LRScheduler | None:
    """The user's scheduler (stepped once per optimizer step), preceded by a linear warm-up."""
    main = None
    if factory is not None:
        kwargs: dict[str, Any] = {}
        if "total_steps" in inspect.signature(factory).parameters:
            kwargs["total_steps"] = max(1, total_steps - warmup_steps)
        main = factory(optimizer, **kwargs)
    if warmup_steps <= 0:
        return main
    warmup = LinearLR(optimizer, start_factor=warmup_start_factor, end_factor=1.0, total_iters=warmup_steps)
    if main is None:
        return warmup
    return SequentialLR(optimizer, schedulers=[warmup, main], milestones=[warmup_steps])


def default_warmup_start_factor(scale: float, warmup_steps: int) -> float:
    """Start at the single-rank LR when the LR is scaled up; otherwise ramp up from lr/warmup_steps."""
    if scale > 1.0:
        return 1.0 / scale
    return 1.0 / max(1, warmup_steps)


def cosine_over_run(optimizer: Optimizer, total_steps: int, eta_min: float = 0.0) -> CosineAnnealingLR:
    return CosineAnnealingLR(optimizer, T_max=total_steps, eta_min=eta_min)


SchedulerFactory = Callable[[int], LRScheduler | None]  # planned schedule steps -> a fresh scheduler


@dataclass(frozen=True)
class Plan:
    """What a schedule is laid out over: its length and its steps per epoch, in schedule steps."""

    total: int
    steps_per_epoch: int


class LRSchedule:
    """The run's LR scheduler, stepped once per optimizer step, and what makes it survive a resume.

    Its clock counts schedule steps. A fresh run, and a run resumed with the same world size and
    budget, advance it by exactly one per optimizer step, so the scheduler steps as usual (and a
    resume is bit for bit). A run resumed on another world size has a different number of steps
    left: the rest of the schedule is stretched over them (the clock advances by remaining
    schedule / remaining steps), so the LR continues where it was and reaches the schedule's end
    on the run's last step. A changed budget (max_epochs, max_steps) re-plans the schedule: from
    the resumed step on, the LR is the one a run planned with the new budget has there.
    """

    def __init__(self, optimizer: Optimizer, factory: SchedulerFactory) -> None:
        self.optimizer = optimizer
        self.factory = factory
        # The LRs before any scheduler touched them (configured LR x scaling): every (re)build starts here.
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.scheduler: LRScheduler | None = None
        self.plan = Plan(0, 0)
        self.clock = 0.0  # schedule steps done (fractional after a resume on another world size)
        self.done = 0  # times the scheduler was stepped: floor(clock)
        self.rate = 1.0  # schedule steps per optimizer step

    def start(self, plan: Plan) -> None:
        self.plan = plan
        self.scheduler = self._fresh(plan.total)

    def _fresh(self, total: int) -> LRScheduler | None:
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = lr
            group.pop("initial_lr", None)  # a scheduler keeps an existing initial_lr: it must see the base LR
        return self.factory(total)

    def step(self) -> None:
        self.clock += self.rate
        target = math.floor(self.clock + 1e-9)
        while self.done < target:
            if self.scheduler is not None:
                self.scheduler.step()
            self.done += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "clock": self.clock,
            "done": self.done,
            "total": self.plan.total,
            "steps_per_epoch": self.plan.steps_per_epoch,
            "base_lrs": self.base_lrs,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def resume(self, saved: dict[str, Any], max_epochs: int | None, steps_done: int, steps_planned: int) -> None:
        """Continue the saved schedule. max_epochs: the epoch budget (None: max_steps); the run's
        optimizer steps done and planned in all (at this world size)."""
        # The schedule's steps per epoch stay those of the world size it was planned on.
        per_epoch = int(saved["steps_per_epoch"])
        total = max_epochs * per_epoch if max_epochs is not None and per_epoch else steps_planned
        self.plan = Plan(total, per_epoch)
        self.clock, self.done = float(saved["clock"]), int(saved["done"])
        left = steps_planned - steps_done
        self.rate = (total - self.clock) / left if left > 0 else 1.0
        same = total == saved["total"] and self.base_lrs == [float(lr) for lr in saved["base_lrs"]]
        if same and saved["scheduler"] is not None:
            self.scheduler = self._fresh(total)
            assert self.scheduler is not None
            self.scheduler.load_state_dict(saved["scheduler"])
            # The scheduler is what says the LR (the optimizer state's copy may lag or be missing).
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
            return
        # Another plan or LR: a scheduler made for it, advanced to the same number of schedule steps.
        self.scheduler = self._fresh(total)
        if self.scheduler is not None:
            for _ in range(self.done):
                self.scheduler.step()
