"""Batch transforms for `data.transform` (by _target_, with _partial_: true): (features, labels) -> batch.

    data.transform: {_target_: dtf.data.transforms.reshape_features, _partial_: true, shape: [1, 28, 28]}

Any callable that takes the batch and returns the batch the step function expects will do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def reshape_features(
    batch: tuple[torch.Tensor, torch.Tensor], shape: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of shape (batch, *shape), e.g. flat 784-value rows as 1x28x28 images for a CNN."""
    features, labels = batch
    return features.reshape(len(features), *shape), labels
