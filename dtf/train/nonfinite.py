"""trainer.on_nonfinite: what a step whose loss or gradients are not finite (NaN, inf) does.

stop (the default) ends the run at that step, before the optimizer applies it, in one line naming
the step (exit status 1); skip leaves the step out (no update; the position, the budget and the LR
schedule advance, as for a step the fp16 gradient scaler skips) and counts it; ignore trains on.
With stop or skip a checkpoint is never written from a non-finite state, and neither is model.pt.

What it costs per step, and how the ranks agree without a collective of their own where they can:
- a local loss that is not finite is folded into the gradients (the loss times NaN, so every
  gradient of that rank becomes NaN), which the strategy's gradient reduction then carries to
  every rank; on the CPU the loss is read as it is (no device sync), on a GPU the fold is a
  multiplication by 1 or NaN computed on the device;
- the gradients are checked with the fused kernel torch's GradScaler uses (multiplying by 1,
  which changes nothing): a few microseconds;
- where every rank holds the same, averaged gradients (DDP, ZeRO-1) each rank decides alone, and
  all alike; where each holds a shard (FSDP, ZeRO-2/3, MiCS) the flag is all-reduced (one float),
  unless clipping already reduced the gradient norm over the ranks;
- with fp16-mixed the gradient scaler owns overflowed gradients (it skips those steps and lowers
  its scale): only a non-finite loss counts here, and its flag is all-reduced.
A checkpoint's state (parameters and optimizer state) is checked before it is written: one more
flag, all-reduced, per save.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtf.config.schema import NonFinite
from dtf.dist.env import DistEnv
from dtf.strategy.base import Strategy
from dtf.train.precision import Precision


class NonFiniteGuard:
    def __init__(self, mode: NonFinite, strategy: Strategy, precision: Precision, env: DistEnv) -> None:
        self.mode = mode
        self.enabled = mode != NonFinite.ignore
        self.env = env
        self.scaled = precision.scaler is not None
        self.multi = dist.is_initialized() and env.world_size > 1
        self.sharded = not strategy.replicated_gradients
        self.skipped = 0  # steps left out (skip), over the run
        self._bad_loss = False  # this rank's, in the current window (CPU, fp16)
        self._bad_loss_flag: torch.Tensor | None = None  # the same on a GPU, without a sync
        self._one = torch.ones((), device=env.device)

    @property
    def stops(self) -> bool:
        return self.mode == NonFinite.stop

    def watch(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: as it is, or, where it is not finite, poisoned so that every
        gradient it reaches is NaN (what the other ranks see after the reduction)."""
        if not self.enabled:
            return loss
        value = loss.detach()
        if value.device.type == "cpu":
            if math.isfinite(value.item()):
                return loss
            self._bad_loss = True
            return loss if self.scaled else loss * math.nan
        finite = torch.isfinite(value)
        self._bad_loss_flag = ~finite if self._bad_loss_flag is None else self._bad_loss_flag | ~finite
        return loss if self.scaled else loss * torch.where(finite, 1.0, math.nan)

    def step_is_finite(self, model: nn.Module, grad_norm: torch.Tensor | None) -> bool:
        """After the window's backward (and clipping, whose norm is given): whether the step may be
        applied. The same answer on every rank."""
        if not self.enabled:
            return True
        flag = torch.zeros(1, device=self.env.device)
        if self._bad_loss:
            flag.fill_(1.0)
        if self._bad_loss_flag is not None:
            flag.add_(self._bad_loss_flag.float())
        self._bad_loss, self._bad_loss_flag = False, None
        if not self.scaled:  # the scaler handles overflowed gradients itself
            if grad_norm is not None:  # reduced over the ranks already, where they are sharded
                flag.add_((~torch.isfinite(grad_norm)).float())
            else:
                _check_into(flag, _local([p.grad for p in model.parameters() if p.grad is not None]), self._one)
        # A rank's own loss flag (fp16), or its shard's gradients (unless their norm was reduced).
        if self.multi and (self.scaled or (self.sharded and grad_norm is None)):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return float(flag.item()) == 0.0

    def state_is_finite(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether every floating-point tensor of this rank's state is finite, on every rank (a
        collective where there are several)."""
        if not self.enabled:
            return True
        flag = torch.zeros(1, device=self.env.device)
        _check_into(flag, _local(tensors), self._one)
        if self.multi:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return float(flag.item()) == 0.0


def _local(tensors: Iterable[torch.Tensor | None]) -> Iterator[torch.Tensor]:
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.is_floating_point() and local.numel():
            yield local


def _check_into(flag: torch.Tensor, tensors: Iterable[torch.Tensor], one: torch.Tensor) -> None:
    """flag becomes non-zero if any element is not finite: GradScaler's fused check, multiplying
    each tensor by 1 (which leaves every value as it was), per device and dtype as it requires."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), group in groups.items():
        found = torch.zeros(1, device=device)
        with torch.no_grad():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, one.to(device))
        flag.add_(found.to(flag.device))
