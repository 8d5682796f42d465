"""ZeRO by stage, on torch's own machinery.

Stage 1 shards the optimizer state: DDP + ZeroRedundancyOptimizer (whole parameters are
assigned to ranks, so an uneven model splits unevenly). Stages 2 and 3 are FSDP2: with
reshard_after_forward=False the gathered parameters live from forward to backward (ZeRO-2),
with True they are freed after forward and gathered again in backward (ZeRO-3). Between steps
FSDP2 keeps parameters sharded in both, so stage 2 also holds 1/N of the parameters at rest.
"""

from __future__ import annotations

import functools
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from dtf.config.schema import DDPStrategyConfig, FSDPStrategyConfig
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.strategy.base import OptimizerFactory, Strategy, local_state_bytes, parameter_and_grad_bytes
from dtf.strategy.ddp import DDPStrategy
from dtf.strategy.fsdp import FSDPStrategy


class Zero1Strategy(DDPStrategy):
    name = "zero"

    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory, env: DistEnv) -> tuple[nn.Module, Optimizer]:
        if not (
            isinstance(optimizer_factory, functools.partial)
            and isinstance(optimizer_factory.func, type)
            and not optimizer_factory.args
        ):
            raise UserError("strategy=zero stage 1 needs an optimizer class with _partial_: true (optimizer._target_)")
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imports TorchScript: only when used

        wrapped, _ = super().setup(model, lambda params: None, env)  # type: ignore[arg-type,return-value]
        optimizer = ZeroRedundancyOptimizer(
            wrapped.parameters(),
            optimizer_class=optimizer_factory.func,
            **optimizer_factory.keywords,
        )
        return wrapped, optimizer

    # ZeroRedundancyOptimizer.state_dict() gathers everything on one rank, keyed by position. Each
    # rank saves its own partition keyed by parameter name instead: the union is the same state
    # DDP or FSDP would save, so DCP can load it onto any world size or strategy.
    def state_dict(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        local: Optimizer = optimizer.optim  # type: ignore[attr-defined]
        # The wrapper copies its groups (the LR the scheduler just set) into the local optimizer only
        # at the start of step(): between steps the local LR lags one scheduler step behind.
        for group, local_group in zip(optimizer.param_groups, local.param_groups, strict=True):
            local_group.update({k: v for k, v in group.items() if k != "params"})
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, local)}

    def load_state_dict(self, model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        local: Optimizer = optimizer.optim  # type: ignore[attr-defined]
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, local, state["optim"])
        # the wrapper's groups are what the scheduler edits and what step() copies into the local ones
        for group, local_group in zip(optimizer.param_groups, local.param_groups, strict=True):
            group.update({k: v for k, v in local_group.items() if k != "params"})

    def model_state_bytes(self, model: nn.Module, optimizer: Optimizer) -> int:
        # ZeroRedundancyOptimizer.state_dict() would gather every rank's state; count this rank's
        # shard: the state of the local optimizer it wraps.
        local: Optimizer = optimizer.optim  # type: ignore[attr-defined]
        return parameter_and_grad_bytes(model) + local_state_bytes(local)


def zero(cfg: DictConfig) -> Strategy:
    if cfg.stage == 1:
        return Zero1Strategy(OmegaConf.structured(DDPStrategyConfig(name="zero")))
    fsdp = FSDPStrategyConfig(
        name="zero",
        reshard_after_forward=cfg.stage == 3,
        block_classes=list(cfg.block_classes) if cfg.block_classes else None,
        meta_init=cfg.meta_init,
    )
    return FSDPStrategy(OmegaConf.structured(fsdp))
