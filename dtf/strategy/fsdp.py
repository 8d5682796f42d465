"""FSDP2: every block, then the root, sharded with torch.distributed.fsdp.fully_shard."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer

from dtf.config.schema import FSDPStrategyConfig
from dtf.dist.env import DistEnv
from dtf.memory import OptimizerFactory, StateShares
from dtf.models import for_shards
from dtf.models.blocks import find_blocks
from dtf.strategy.base import AUTOCAST_DTYPES, Strategy, initialise
from dtf.strategy.cpu_overlap import overlap_on_cpu


class FSDPStrategy(Strategy):
    name = "fsdp"
    cfg: FSDPStrategyConfig
    replicated_gradients = False  # each rank holds its shard of them

    @property
    def reduce_scatter_beside_backward(self) -> bool:
        """On CPU, whether a unit's reduce-scatter may end after its post-backward: nothing reads
        its output before the end of the backward (dtf.strategy.cpu_overlap)."""
        return True

    def mesh(self, env: DistEnv) -> DeviceMesh:
        return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("shard",))

    def shard_size(self, world_size: int) -> int:
        """How many ranks share one copy of the model state, each holding a shard."""
        return world_size

    def state_shares(self, world_size: int) -> StateShares:
        n = self.shard_size(world_size)
        over = f"sharded over {n} ranks" + (f", replicated {world_size // n} times" if world_size > n else "")
        offload = self.cfg.cpu_offload
        if self.cfg.reshard_after_forward:
            return StateShares(1 / n, 1 / n, 1 / n, f"ZeRO-3: all {over}", on_host=offload)
        # ZeRO-2: the gathered parameters live from forward to backward
        return StateShares(1, 1 / n, 1 / n, f"ZeRO-2: gradients and optimizer state {over}", on_host=offload)

    def mixed_precision(self) -> MixedPrecisionPolicy:
        """trainer.precision=*-mixed: parameters gathered in the low dtype (what autocast would cast
        them to), gradients reduced in fp32 (as DDP reduces the fp32 gradients of autocast)."""
        low = AUTOCAST_DTYPES.get(self.precision)
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)

    def grad_scaler(self, device: torch.device) -> GradScaler:
        # Each rank holds a shard of the gradients: the scaler all-reduces whether any overflowed.
        return _ShardedGradScaler(device.type)

    def build_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        """As every strategy does, but a model whose weights come from files (model=hf) builds on
        meta whatever strategy.meta_init says: each rank allocates only its shards, and the weights
        go into them after sharding (initialise, then load_pretrained_in_place), read by rank 0 alone."""
        with for_shards():
            return super().build_model(build)

    def _shard_kwargs(self, env: DistEnv) -> dict[str, Any]:
        cfg = self.cfg
        mp = self.mixed_precision()
        offload: OffloadPolicy = (
            CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if cfg.cpu_offload else OffloadPolicy()
        )
        self._mesh = self.mesh(env)
        return {"mesh": self._mesh, "mp_policy": mp, "offload_policy": offload}

    def _shard(self, module: nn.Module, env: DistEnv, kwargs: dict[str, Any]) -> nn.Module:
        blocks = find_blocks(module, self.cfg.block_classes)
        reshard = self.cfg.reshard_after_forward
        # Innermost first: a block inside a block must be its own unit before its parent is.
        for block in reversed(blocks):
            fully_shard(block, reshard_after_forward=reshard, **kwargs)
        fully_shard(module, reshard_after_forward=reshard, **kwargs)
        if env.device.type == "cpu":  # FSDP2 overlaps by CUDA streams; on CPU, by gloo's threads
            overlap_on_cpu(module, blocks, reduce_scatter=self.reduce_scatter_beside_backward)
        if any(p.is_meta for p in module.parameters()):
            self._materialise(module, env)
        return module

    def _materialise(self, module: nn.Module, env: DistEnv) -> None:
        """Allocate only the local shards, then let each module initialise its own (sharded) tensors.
        Seeded with seed + the shard's index: shards are not copies of each other, and the ranks that
        hold the same shard (replicas, in MiCS/HSDP) start with the same values, as they must."""
        module.to_empty(device="cpu" if self.cfg.cpu_offload else env.device)
        torch.manual_seed(torch.initial_seed() + self._mesh.get_local_rank("shard"))
        initialise(module)

    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory, env: DistEnv) -> tuple[nn.Module, Optimizer]:
        kwargs = self._shard_kwargs(env)
        if not self.cfg.cpu_offload and not any(p.is_meta for p in model.parameters()):
            model = model.to(env.device)
        if isinstance(model, nn.ModuleDict):  # several modules: each is its own root
            for child in model.values():
                self._shard(child, env, kwargs)
        else:
            self._shard(model, env, kwargs)
        return model, optimizer_factory(model.parameters())

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return _no_gradient_sync(model)


class _ShardedGradScaler(ShardedGradScaler):
    """torch's, without DTensor's warning at every step that the (1,)-shaped overflow flag it is
    handed beside the gradient shards is taken as replicated (which is what the scaler means)."""

    def unscale_(self, optimizer: Optimizer) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Found a non-scalar tensor with numel=1")
            super().unscale_(optimizer)


def _roots(model: nn.Module) -> list[FSDPModule]:
    if isinstance(model, FSDPModule):
        return [model]
    return [m for m in model.children() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    roots = _roots(model)
    for root in roots:
        root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for root in roots:
            root.set_requires_gradient_sync(True)
