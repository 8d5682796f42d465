"""Names torch 2.12 and 2.13 changed, for the torch releases dtf supports (2.10 on; pyproject.toml):
one place that says which name each release has."""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single: the same collective.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers, whose False still syncs the buffers
# once, at the start (the old name's False skips that too: the same when every rank builds the
# model alike, as dtf's ranks do).
DDP_SYNC_BUFFERS = next(
    n
    for n in ("forward_sync_buffers", "broadcast_buffers")
    if n in inspect.signature(DistributedDataParallel).parameters
)


def fsdp_param_groups(module: nn.Module) -> list[Any]:
    """An FSDP2 module's parameter groups: a list from torch 2.12 on, one group (or none) before."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    return list(groups)
