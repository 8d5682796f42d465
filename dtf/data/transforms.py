"""Batch transforms for `data.transform`: each takes a (features, labels) batch and returns one.

`data.transform` is one of them or a list, applied in order, e.g. for 8-bit HWC images:

    data:
      transform:
        - {_target_: dtf.data.transforms.Scale, divisor: 255}               # uint8 0..255 -> 0..1
        - {_target_: dtf.data.transforms.Normalize, mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25], channel_dim: -1}
        - {_target_: dtf.data.transforms.Permute, dims: [2, 0, 1]}          # HWC -> CHW

Features already arrive as floats (data.feature_dtype), so these work in the model's dtype.
Any callable that takes the batch and returns the batch the step function expects will do
(a function with `_partial_: true`, or an object built by `_target_`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtf.errors import UserError

Batch = tuple[torch.Tensor, torch.Tensor]


class Scale:
    """features x factor / divisor: `divisor: 255` maps 8-bit pixels to [0, 1]."""

    def __init__(self, factor: float = 1.0, divisor: float = 1.0) -> None:
        if divisor == 0:
            raise UserError("data.transform: Scale(divisor=0) divides by zero: give a non-zero divisor")
        self.multiplier = float(factor) / float(divisor)

    def __call__(self, batch: Batch) -> Batch:
        features, labels = batch
        return features * self.multiplier, labels


class Normalize:
    """(features - mean) / std per channel: one value each per entry along channel_dim
    (a dim of the batch: 1 for NCHW or flat features, -1 for NHWC), or one for all."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], channel_dim: int = 1) -> None:
        self.mean = torch.as_tensor(list(mean), dtype=torch.float64).reshape(-1)
        self.std = torch.as_tensor(list(std), dtype=torch.float64).reshape(-1)
        if len(self.mean) != len(self.std) or bool((self.std == 0).any()):
            raise UserError(
                f"data.transform: Normalize needs as many means as stds ({len(self.mean)} vs {len(self.std)}) "
                "and no std of 0"
            )
        self.channel_dim = channel_dim

    def __call__(self, batch: Batch) -> Batch:
        features, labels = batch
        dim = self.channel_dim % features.ndim
        n = len(self.mean)
        if dim == 0 or (n != 1 and features.shape[dim] != n):
            raise UserError(
                f"data.transform: Normalize has {n} means and {n} stds for {features.shape[dim]} values along dim "
                f"{self.channel_dim} of the features (shape {tuple(features.shape)}): give one per channel, or set "
                "channel_dim (a dim of the batch: 1 for NCHW, -1 for NHWC)"
            )
        shape = [1] * features.ndim
        shape[dim] = n
        mean = self.mean.to(features.dtype).reshape(shape)
        std = self.std.to(features.dtype).reshape(shape)
        return (features - mean) / std, labels


class Reshape:
    """Features of shape (batch, *shape), e.g. flat 784-value rows as 1x28x28 images (-1: inferred)."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = tuple(int(d) for d in shape)

    def __call__(self, batch: Batch) -> Batch:
        features, labels = batch
        return features.reshape(len(features), *self.shape), labels


class Permute:
    """Reorders the per-row dims: `dims: [2, 0, 1]` turns HWC images (as decoded) into CHW (as conv layers want)."""

    def __init__(self, dims: Sequence[int]) -> None:
        self.dims = tuple(int(d) + 1 for d in dims)

    def __call__(self, batch: Batch) -> Batch:
        features, labels = batch
        return features.permute(0, *self.dims), labels


def reshape_features(batch: Batch, shape: Sequence[int]) -> Batch:
    """As Reshape, for `{_target_: dtf.data.transforms.reshape_features, _partial_: true, shape: [...]}`."""
    return Reshape(shape)(batch)
