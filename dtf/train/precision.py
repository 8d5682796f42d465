"""trainer.precision, the same switch for every strategy: what the loop does around forward,
backward and the optimizer step.

- 32: nothing.
- bf16-mixed, fp16-mixed: autocast around forward and loss (parameters, gradients and optimizer
  state stay fp32). fp16 adds a gradient scaler (the strategy's: FSDP2's gradients are shards,
  so its scaler agrees on an overflow across ranks); its state is in the trainer's checkpoint.
  The FSDP2 family also gathers parameters in the low dtype and reduces gradients in fp32
  (MixedPrecisionPolicy, set by the strategy from the same switch).
- bf16-true: the model's parameters in bf16, and the floating-point tensors of every batch.

A step whose fp16 gradients overflowed is skipped by the scaler, on every rank alike (the
gradients, or the overflow flag, are the same everywhere). It still counts as a step, as in
torch's AMP recipe and in Lightning: the position, the budget and the LR schedule advance with
it, so a run stays in step with its checkpoints and its resumes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler
from torch.optim import Optimizer
from torch.utils._pytree import tree_map

from dtf.strategy.base import AUTOCAST_DTYPES


class Precision:
    """One rank's precision mechanics. scaler: the strategy's gradient scaler (fp16-mixed only)."""

    def __init__(self, setting: str, device: torch.device, scaler: GradScaler | None = None) -> None:
        self.setting = setting
        self.device = device
        self.autocast_dtype = AUTOCAST_DTYPES.get(setting)
        self.scaler = scaler if setting == "fp16-mixed" else None
        self.skipped_steps = 0

    @property
    def true_bf16(self) -> bool:
        return self.setting == "bf16-true"

    def convert_model(self, model: nn.Module) -> nn.Module:
        """bf16-true: the parameters (and buffers) in bf16, before the strategy shards or wraps them."""
        return model.to(torch.bfloat16) if self.true_bf16 else model

    def convert_batch(self, batch: Any) -> Any:
        """bf16-true: floating-point tensors in bf16, as the model's parameters (integer labels stay)."""
        if not self.true_bf16:
            return batch
        return tree_map(lambda t: t.to(torch.bfloat16) if _floating(t) else t, batch)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Around forward and loss, in training and evaluation alike."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: Optimizer) -> None:
        """The true gradients, before anything reads them (clipping); at most once per step."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: Optimizer) -> bool:
        """Steps the optimizer, unless fp16 gradients overflowed (then the scaler backs off).
        Returns whether the parameters were updated."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scale shrinks exactly when the step was skipped (as Accelerate tells a skipped step).
        stepped = self.scaler.get_scale() >= before
        self.skipped_steps += not stepped
        return stepped

    def skip(self) -> None:
        """A step left out before the optimizer saw it (trainer.on_nonfinite=skip): the scaler,
        which may have unscaled the gradients already, starts its next step afresh, its scale kept."""
        if self.scaler is not None:
            self.scaler.update(new_scale=self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint without scaler state (written without fp16-mixed, or by an older dtf) leaves
        the scaler as a fresh run has it."""
        if self.scaler is not None and state and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self.skipped_steps = int(state.get("skipped_steps", 0))


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()
