"""Samplers that shard a map-style dataset across ranks.

ResumableDistributedSampler: torch's DistributedSampler, able to start an epoch part-way
(a mid-epoch resume).

EvalShardSampler: evaluation sharding that counts every sample exactly once. DistributedSampler
pads the last ranks with repeated samples so that all ranks run the same number of batches; for
training that is harmless, for a test metric it is a bias. EvalShardSampler keeps the equal length
(sharded strategies need every rank to run the same number of forwards) but tells which trailing
positions are padding, so the trainer gives them weight zero.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler, Sampler


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start the current epoch after its first `skip` samples
    (a mid-epoch resume); the next set_epoch() starts from the beginning again."""

    skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


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
