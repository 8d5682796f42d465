"""What the trainer does to a batch, whatever its container: dicts, lists, tuples, namedtuples
(torch's pytree walks them all), with tensors anywhere inside."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with its tensors on device, its containers (dicts, lists, tuples, namedtuples) kept."""
    if device.type == "cpu":
        return batch
    return tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)


def take_first(batch: Any, n: int) -> Any:
    """The first n samples of a batch: every tensor cut, its containers (dicts, lists, tuples,
    namedtuples) kept as they are."""
    return tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) else t, batch)


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: dim 0 of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        for item in batch:
            n = batch_size_of(item)
            if n >= 0:
                return n
    return -1
