"""MiCS / ZeRO-2D as HSDP: FSDP2 sharding inside groups of G ranks, replicated across them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from dtf.config.schema import MicsStrategyConfig
from dtf.dist.env import DistEnv
from dtf.memory import OptimizerFactory
from dtf.strategy.fsdp import FSDPStrategy


class MicsStrategy(FSDPStrategy):
    name = "mics"
    cfg: MicsStrategyConfig

    def shard_size(self, world_size: int) -> int:
        return self.cfg.partition_group_size

    def mesh(self, env: DistEnv) -> DeviceMesh:
        group = self.cfg.partition_group_size
        # Consecutive ranks form a partition group: on a real cluster, the ranks of one node,
        # so the frequent all-gathers stay on the fast links and only the all-reduce crosses nodes.
        mesh = init_device_mesh(
            env.device.type, (env.world_size // group, group), mesh_dim_names=("replicate", "shard")
        )
        if env.device.type == "cuda":
            return mesh  # HSDP: FSDP2 all-reduces across the groups on a stream of its own, beside the backward
        # Elsewhere FSDP2's streams are no-ops and its HSDP all-reduce would hold up the backward for as
        # long as the slow links take: FSDP2 shards inside the group (a 1-D mesh), and each unit's
        # reduced shard is all-reduced across the groups asynchronously, while the backward goes on.
        self._across = _AcrossGroups(mesh.get_group("replicate"))
        return mesh["shard"]

    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory, env: DistEnv) -> tuple[nn.Module, Any]:
        model, optimizer = super().setup(model, optimizer_factory, env)
        across = getattr(self, "_across", None)
        if across is not None and across.size > 1:
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(across.reduce)
        return model, optimizer


class _AcrossGroups:
    """The all-reduce across the partition groups, one per sharded unit, started as FSDP2 hands
    each unit's reduced gradient shard to its parameters (their post-accumulate-grad hooks), and
    waited for at the end of the backward (an autograd final callback): before the optimizer,
    the clipping or the non-finite checks read a gradient. The shards, averaged inside a group by
    FSDP2's reduce-scatter, are summed across the groups and divided by their number."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.pending: dict[int, tuple[dist.Work, torch.Tensor]] = {}

    def reduce(self, param: torch.Tensor) -> None:
        grad = param.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local is None:
            return
        storage = local.untyped_storage()  # a unit's parameters share one: its reduce-scatter's output
        key = storage.data_ptr()
        if key in self.pending:
            return
        flat = torch.empty(0, dtype=local.dtype, device=local.device).set_(storage)
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
        self.pending[key] = (dist.all_reduce(flat, group=self.group, async_op=True), flat)

    def wait(self) -> None:
        for work, flat in self.pending.values():
            work.wait()
            flat.div_(self.size)
        self.pending.clear()
