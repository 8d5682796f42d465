"""Evaluation sharding that counts every sample exactly once.

DistributedSampler pads the last ranks with repeated samples so that all ranks run
the same number of batches; for training that is harmless, for a test metric it is a
bias. EvalShardSampler keeps the equal length (sharded strategies need every rank
to run the same number of forwards) but tells which trailing positions are padding,
so the trainer gives them weight zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import Sampler


class EvalShardSampler(Sampler[int]):
    def __init__(self, num_samples: int, rank: int, world_size: int) -> None:
        own = list(range(rank, num_samples, world_size))
        self.num_real = len(own)
        self.length = math.ceil(num_samples / world_size)
        # Pad with this rank's own first sample (or sample 0 if it has none); the padded
        # positions are always the last ones, so a batch's real part is a prefix.
        filler = own[0] if own else 0
        self.indices = own + [filler] * (self.length - len(own))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.length

    def num_real_in_batch(self, batch_index: int, batch_size: int) -> int:
        return max(0, min(batch_size, self.num_real - batch_index * batch_size))


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
