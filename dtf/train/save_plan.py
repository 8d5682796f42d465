"""Which rank writes what of a checkpoint: DCP's default plan, with the small replicated items on
one rank.

DCP writes each item every rank holds alike (an optimizer's settings, Adam's step counts, DDP's
parameters) once, on the rank with the least to write so far, which spreads the tiny ones over
every rank's file, between its shards. Every rank that resumes needs all of them, so each fetched
a few byte ranges from every other rank's file: at 8 ranks on S3, about 200 requests of a few KB
each. Here they all go to the lowest rank that holds them, ahead of everything else in its
file, so that each rank fetches them in one request. Large replicated items (a DDP model's
weights) are still spread, so that the ranks share the writing.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

# A replicated item up to this size is written by the lowest rank that holds it.
SMALL_ITEM_BYTES = 64 << 10


def _small(item: WriteItem) -> bool:
    return item.type == WriteItemType.BYTE_IO or (item.tensor_storage_size() or 0) <= SMALL_ITEM_BYTES


class SmallReplicasOnOneRank(DefaultSavePlanner):
    """DCP's default save planner, but for where its small replicated items are written."""

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        holders: dict[MetadataIndex, list[int]] = defaultdict(list)
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                if _small(item):
                    holders[item.index].append(rank)
        others: list[set[MetadataIndex]] = [set() for _ in all_plans]
        for index, ranks in holders.items():
            for rank in ranks[1:]:
                others[rank].add(index)
        kept = [
            dataclasses.replace(plan, items=[item for item in plan.items if item.index not in others[rank]])
            for rank, plan in enumerate(all_plans)
        ]
        # Small items first: a rank's file is written in its plan's order (one file a rank, one
        # thread), so rank 0's small replicated items end up next to each other, one byte range.
        return [
            dataclasses.replace(plan, items=sorted(plan.items, key=lambda item: not _small(item)))
            for plan in super()._dedup_save_plans(kept)
        ]
