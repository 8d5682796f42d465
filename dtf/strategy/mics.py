"""MiCS / ZeRO-2D as HSDP: FSDP2 on a 2-D mesh (replicate across groups, shard inside one)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from dtf.config.schema import MicsStrategyConfig
from dtf.dist.env import DistEnv
from dtf.memory import OptimizerFactory
from dtf.strategy.cpu_overlap import own_parameters
from dtf.strategy.fsdp import FSDPStrategy

# How far strategy.cross_group_dtype=bfloat16 may take a model from DDP's, as the relative L2
# distance of all the parameters as one vector (relative_distance): its gradients cross between the
# groups with 8 bits of mantissa, an error of up to 2^-9 of each, which the steps carry on.
# tests/dist/test_strategies.py (measured 0.97% after 32 SGD steps with momentum) and
# benchmarks/topology.py hold it to this.
BF16_ACROSS_TOLERANCE = 3e-2


def relative_distance(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor]) -> float:
    """|ours - theirs| / |theirs|, the parameters of each model taken as one vector."""
    apart = sum(float((ours[k].double() - theirs[k].double()).square().sum()) for k in theirs)
    size = sum(float(theirs[k].double().square().sum()) for k in theirs)
    return (apart / size) ** 0.5


class MicsStrategy(FSDPStrategy):
    name = "mics"
    cfg: MicsStrategyConfig
    _across: _AcrossGroups | None = None

    def shard_size(self, world_size: int) -> int:
        return self.cfg.partition_group_size

    def mesh(self, env: DistEnv) -> DeviceMesh:
        group = self.cfg.partition_group_size
        # Consecutive ranks form a partition group: on a real cluster, the ranks of one node,
        # so the frequent all-gathers stay on the fast links and only the all-reduce crosses nodes.
        mesh = init_device_mesh(
            env.device.type, (env.world_size // group, group), mesh_dim_names=("replicate", "shard")
        )
        if mesh.size(0) == 1 or (self.cfg.cross_group_dtype == "float32" and env.device.type != "cpu"):
            return mesh  # HSDP: FSDP2 all-reduces across the groups on a CUDA stream, beside the backward
        # FSDP2 shards inside the group (a 1-D mesh) and its all-reduce hook reduces each unit's shard
        # across the groups: in the narrower dtype, where one is set (FSDP2's HSDP would narrow the
        # reduce-scatter inside the group too), and on CPU, where FSDP2's streams are no-ops and its
        # HSDP all-reduce would hold up the backward, started in gloo's threads while the backward goes on.
        self._across = _AcrossGroups(getattr(torch, self.cfg.cross_group_dtype), mesh.get_group("replicate"))
        return mesh["shard"]

    @property
    def reduce_scatter_beside_backward(self) -> bool:
        return self._across is None  # its all-reduce hook reads the reduce-scatter's output at once

    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory, env: DistEnv) -> tuple[nn.Module, Any]:
        model, optimizer = super().setup(model, optimizer_factory, env)
        if self._across is not None:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_all_reduce_hook(functools.partial(self._across, own_parameters(module)))
        return model, optimizer


class _AcrossGroups:
    """FSDP2's all-reduce hook: a unit's gradient shard, already averaged inside the group by the
    reduce-scatter, averaged across the groups (in `dtype`) and written back in place, where FSDP2
    views the sharded gradients out of it.

    On CPU the all-reduce runs in gloo's threads while the backward goes on, and the shards are
    written back at the end of the backward (an autograd final callback), before anything reads a
    gradient. Not where the unit's gradients already hold a previous backward's (accumulated
    without no_sync): FSDP2 adds the new shard to them as soon as the hook returns."""

    def __init__(self, dtype: torch.dtype, group: dist.ProcessGroup) -> None:
        self.dtype = dtype
        self.group = group
        self.size = dist.get_world_size(group)
        self.pending: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []

    def __call__(self, unit_parameters: list[nn.Parameter], reduce_output: torch.Tensor) -> None:
        narrow = (reduce_output / self.size).to(self.dtype)
        if reduce_output.device.type != "cpu" or any(p.grad is not None for p in unit_parameters):
            dist.all_reduce(narrow, group=self.group)  # on CUDA: on FSDP2's all-reduce stream
            reduce_output.copy_(narrow)
            return
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self.pending.append((dist.all_reduce(narrow, group=self.group, async_op=True), narrow, reduce_output))

    def finish(self) -> None:
        for work, narrow, reduce_output in self.pending:
            work.wait()
            reduce_output.copy_(narrow)
        self.pending.clear()
