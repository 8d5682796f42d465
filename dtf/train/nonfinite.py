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

On a GPU, reading the flag on the host every step would wait for the device every step. Where the
optimizer can leave a step out on the device itself (torch's fused optimizers take a `found_inf`
tensor, as GradScaler uses them: `optimizer=adam +optimizer.fused=true`), the flag is handed to it
and read one step later, just before the next update, waiting only for the device to have finished
the step before (never for the work queued since). A step that was not finite was then left out by
the optimizer, and the loop acts on it there: the run stops naming that step, with no later update
applied, or the skip is counted and the step's losses are left out of the epoch's. Before a
checkpoint, an evaluation or an epoch's end every verdict is read. Other optimizers, and fp16 (whose
scaler reads its own flag), read the flag at once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtf.config.schema import NonFinite
from dtf.dist.env import DistEnv
from dtf.strategy.base import Strategy
from dtf.train.precision import Precision


@dataclass
class Pending:
    """A step handed to the optimizer with its flag, whose verdict is read a step later."""

    step: int
    host: torch.Tensor  # the flag's value, copied off the device without waiting
    event: torch.cuda.Event | None  # recorded after the copy (None on the CPU: the copy is done)
    payload: Any  # what the loop keeps until the verdict (the step's losses)

    def finite(self) -> bool:
        if self.event is not None:
            self.event.synchronize()  # the device reached this step's end, not the work queued after it
        return float(self.host.item()) == 0.0


class NonFiniteGuard:
    # Tests only: the GPU's deferred verdicts, run on the CPU (fused optimizers take found_inf there too).
    DEFER_ON_CPU = False

    def __init__(
        self, mode: NonFinite, strategy: Strategy, precision: Precision, env: DistEnv, optimizer: Any = None
    ) -> None:
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
        # 0-dim, as the fused optimizers' found_inf; reused every step: no allocation on the hot path
        self._flag = torch.zeros((), device=env.device)
        self._model: nn.Module | None = None  # the model whose parameters are listed below
        self._params: list[nn.Parameter] = []  # listed once: walking the modules every step cost ~40 us
        self._dtensors = False  # some parameters are DTensors (their gradients' local shards are checked)
        on_device = env.device.type == "cuda" or (self.DEFER_ON_CPU and env.device.type == "cpu")
        skips_on_device = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.defers = self.enabled and not self.scaled and on_device and skips_on_device
        self._pending: deque[Pending] = deque()

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
        return float(self._window_flag(model, grad_norm).item()) == 0.0

    def _window_flag(self, model: nn.Module, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """Non-zero where the window's loss, or its gradients, are not finite on some rank."""
        flag = self._flag
        flag.fill_(1.0 if self._bad_loss else 0.0)
        if self._bad_loss_flag is not None:
            flag.add_(self._bad_loss_flag.float())
        self._bad_loss, self._bad_loss_flag = False, None
        if not self.scaled:  # the scaler handles overflowed gradients itself
            if grad_norm is not None:  # reduced over the ranks already, where they are sharded
                flag.add_((~torch.isfinite(grad_norm)).float())
            else:
                _check_into(flag, self._gradients(model), self._one)
        # A rank's own loss flag (fp16), or its shard's gradients (unless their norm was reduced).
        if self.multi and (self.scaled or (self.sharded and grad_norm is None)):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def _gradients(self, model: nn.Module) -> Iterable[torch.Tensor]:
        """This rank's gradients (local shards of DTensors), from the parameters listed once per model."""
        if model is not self._model:
            self._model, self._params = model, list(model.parameters())
            self._dtensors = any(isinstance(p, DTensor) for p in self._params)
        grads = [p.grad for p in self._params if p.grad is not None]
        return _local(grads) if self._dtensors else grads

    def hand_to_optimizer(
        self, model: nn.Module, grad_norm: torch.Tensor | None, optimizer: Any, step: int, payload: Any
    ) -> None:
        """Deferred: the window's flag, computed on the device as step_is_finite's, becomes the
        optimizer's found_inf (its update is left out where the flag is set); the verdict is read
        a step later (verdicts)."""
        flag = self._window_flag(model, grad_norm)
        optimizer.found_inf, optimizer.grad_scale = flag, None
        if self.env.device.type == "cuda":
            host = torch.empty((), pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event: torch.cuda.Event | None = torch.cuda.Event()
            event.record()  # type: ignore[union-attr]
        else:
            host, event = flag.clone(), None
        self._pending.append(Pending(step, host, event, payload))

    def verdicts(self, keep_latest: bool = False) -> Iterator[tuple[int, bool, Any]]:
        """(step, finite, payload) of the deferred steps, oldest first; keep_latest: all but the
        newest (the step just handed over, when the next is about to be)."""
        while len(self._pending) > (1 if keep_latest else 0):
            pending = self._pending.popleft()
            yield pending.step, pending.finite(), pending.payload

    def count_skip(self, step: int) -> None:
        """trainer.on_nonfinite=skip: the step was left out (no update); said on the first and every
        tenfold one, counted in summary.json."""
        self.skipped += 1
        n = self.skipped
        if self.env.is_main and (n == 1 or math.log10(n).is_integer()):
            print(
                f"dtf: warning: step {step}: the loss or its gradients are not finite (NaN or inf); the step is "
                f"skipped (trainer.on_nonfinite=skip), {n} so far",
                flush=True,
            )

    def state_is_finite(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether every floating-point tensor of this rank's state is finite, on every rank (a
        collective where there are several)."""
        if not self.enabled:
            return True
        flag = torch.zeros((), device=self.env.device)
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
        # found is set to 1 where a value is not finite, and never cleared: the flag itself serves
        # where it lives on the same device.
        found = flag if device == flag.device else torch.zeros(1, device=device)
        with torch.no_grad():
            torch._amp_foreach_non_finite_check_and_unscale_(
                group, found, one if device == flag.device else one.to(device)
            )
        if found is not flag:
            flag.add_(found.to(flag.device))
