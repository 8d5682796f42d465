"""The loss as step functions receive it: the configured loss, handed targets in the shape and
dtype the model's output needs.

Labels arrive as users store them: a scalar Parquet column or a flat target tensor gives (B,),
while a regression model outputs (B, 1); torch's elementwise losses would broadcast the two to
(B, B), warn once and train on the wrong target. Spark stores class labels as doubles. So a
target with as many elements as the output is shaped like it, one that would broadcast is
refused in one line, and class indices stored as floats become indices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtf.errors import UserError

# Losses that compare output and target element by element (and broadcast silently when shapes differ).
ELEMENTWISE = (
    nn.MSELoss,
    nn.L1Loss,
    nn.SmoothL1Loss,
    nn.HuberLoss,
    nn.BCELoss,
    nn.BCEWithLogitsLoss,
    nn.SoftMarginLoss,
)
# Losses whose target is a class index per sample.
CLASS_INDEX = (nn.CrossEntropyLoss, nn.NLLLoss)


class TargetsLikeOutput:
    """Wraps loss_fn(output, target, ...); label_key names where the labels come from, for messages."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], label_key: str) -> None:
        self.loss_fn = loss_fn
        self.label_key = label_key
        self.elementwise = isinstance(loss_fn, ELEMENTWISE)
        self.class_index = isinstance(loss_fn, CLASS_INDEX)

    def __getattr__(self, name: str) -> Any:  # a step function may read the loss's settings (reduction, ...)
        return getattr(self.loss_fn, name)

    def __call__(self, output: Any, target: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor):
            target = self.shape_target(output, target)
        return self.loss_fn(output, target, *args, **kwargs)

    def shape_target(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """target as the loss needs it: shaped like the output, or as class indices."""
        if self.elementwise:
            return self._like_output(output, target)
        if self.class_index and target.is_floating_point() and target.dim() == output.dim() - 1:
            return self._as_indices(target)
        return target

    def _like_output(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.shape != output.shape:
            if target.numel() != output.numel():
                raise UserError(
                    f"{self.label_key}: labels of shape {tuple(target.shape)} do not match the model's output "
                    f"{tuple(output.shape)}, and {type(self.loss_fn).__name__} would broadcast them: give one "
                    "label value per output value (or change the model's output size)"
                )
            target = target.reshape(output.shape)
        if target.dtype != output.dtype:
            target = target.to(output.dtype)  # integer targets of a regression
        return target

    def _as_indices(self, target: torch.Tensor) -> torch.Tensor:
        indices = target.long()
        if not torch.equal(indices.to(target.dtype), target):
            raise UserError(
                f"{self.label_key}: {type(self.loss_fn).__name__} needs class indices, but the labels hold "
                "non-integer values: store the class number of each sample (or pick a regression loss)"
            )
        return indices
