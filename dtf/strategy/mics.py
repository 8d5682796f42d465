"""MiCS / ZeRO-2D as HSDP: FSDP2 on a 2-D mesh (replicate across groups, shard inside one)."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtf.config.schema import MicsStrategyConfig
from dtf.dist.env import DistEnv
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
        return init_device_mesh(
            env.device.type, (env.world_size // group, group), mesh_dim_names=("replicate", "shard")
        )
