"""A batch's loss as training and evaluation both compute it: the step function (trainer.step_fn,
or supervised_step) under the precision's autocast, with the batch converted as the precision wants."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtf.data.batch import batch_size_of
from dtf.train.precision import Precision

if TYPE_CHECKING:
    from dtf.train.metrics import Metrics

StepFn = Callable[[nn.Module, Any, Callable[..., torch.Tensor]], Any]


def supervised_step(model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    """The default step: batch = (inputs, targets); the loss of model(inputs) against targets."""
    inputs, targets = batch
    return loss_fn(model(inputs), targets)


@dataclass(frozen=True)
class Forward:
    step_fn: StepFn
    loss_fn: Callable[..., torch.Tensor]
    precision: Precision

    def __call__(self, model: nn.Module, batch: Any, metrics: Metrics | None) -> tuple[torch.Tensor, int]:
        """The batch's loss and how many samples it counts; metrics see what the loss sees."""
        batch = self.precision.convert_batch(batch)
        with self.precision.autocast():
            out = self.step_fn(model, batch, metrics.observing(self.loss_fn) if metrics else self.loss_fn)
        loss, count = (out[0], int(out[1])) if isinstance(out, tuple) else (out, batch_size_of(batch))
        if metrics:
            metrics.observe_loss(loss, count)
        return loss, count
