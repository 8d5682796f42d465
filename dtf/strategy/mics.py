"""MiCS / ZeRO-2D as HSDP: FSDP2 on a 2-D mesh (replicate across groups, shard inside one)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from dtf.config.schema import MicsStrategyConfig
from dtf.dist.env import DistEnv
from dtf.memory import OptimizerFactory
from dtf.strategy.fsdp import FSDPStrategy


class MicsStrategy(FSDPStrategy):
    name = "mics"
    cfg: MicsStrategyConfig
    _across: _AcrossGroupsIn | None = None

    def shard_size(self, world_size: int) -> int:
        return self.cfg.partition_group_size

    def mesh(self, env: DistEnv) -> DeviceMesh:
        group = self.cfg.partition_group_size
        # Consecutive ranks form a partition group: on a real cluster, the ranks of one node,
        # so the frequent all-gathers stay on the fast links and only the all-reduce crosses nodes.
        mesh = init_device_mesh(
            env.device.type, (env.world_size // group, group), mesh_dim_names=("replicate", "shard")
        )
        if self.cfg.cross_group_dtype == "float32" or mesh.size(0) == 1:
            return mesh
        # FSDP2's HSDP all-reduces across the groups in its reduce dtype, the one its reduce-scatter
        # inside a group uses too. To send fewer bytes across only, FSDP2 shards inside the group
        # (a 1-D mesh) and its all-reduce hook reduces each unit's shard across the groups.
        self._across = _AcrossGroupsIn(getattr(torch, self.cfg.cross_group_dtype), mesh.get_group("replicate"))
        return mesh["shard"]

    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory, env: DistEnv) -> tuple[nn.Module, Any]:
        model, optimizer = super().setup(model, optimizer_factory, env)
        if self._across is not None:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_all_reduce_hook(self._across)
        return model, optimizer


class _AcrossGroupsIn:
    """FSDP2's all-reduce hook: a unit's gradient shard, already averaged inside the group by the
    reduce-scatter, averaged across the groups in a narrower dtype, and written back in place
    (FSDP2 then views the sharded gradients out of it)."""

    def __init__(self, dtype: torch.dtype, group: dist.ProcessGroup) -> None:
        self.dtype = dtype
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(self, reduce_output: torch.Tensor) -> None:
        narrow = (reduce_output / self.size).to(self.dtype)
        dist.all_reduce(narrow, group=self.group)
        reduce_output.copy_(narrow)
