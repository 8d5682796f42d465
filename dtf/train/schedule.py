"""Learning-rate scaling with the world size, warm-up, and the user's scheduler."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR


def lr_scale_factor(mode: str, world_size: int) -> float:
    """Goyal et al. / Horovod: grow the LR with the global batch (linear), or its square root."""
    return {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[mode]


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
