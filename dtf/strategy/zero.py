"""ZeRO by stage, on torch's own machinery.

Stage 1 shards the optimizer state: DDP + dtf's ShardedOptimizer (dtf/strategy/zero1.py), each
rank stepping an equal, element-wise slice of all parameters. Stages 2 and 3 are FSDP2: with
reshard_after_forward=False the gathered parameters live from forward to backward (ZeRO-2),
with True they are freed after forward and gathered again in backward (ZeRO-3). Between steps
FSDP2 keeps parameters sharded in both, so stage 2 also holds 1/N of the parameters at rest.
"""

from __future__ import annotations

from dtf.config.schema import DDPStrategyConfig, FSDPStrategyConfig, ZeroStrategyConfig
from dtf.strategy.base import Strategy
from dtf.strategy.fsdp import FSDPStrategy
from dtf.strategy.zero1 import Zero1Strategy


def zero(cfg: ZeroStrategyConfig, precision: str = "32") -> Strategy:
    """The strategy of a ZeRO stage; whatever runs underneath, it is named (and reports as) zero."""
    if cfg.stage == 1:
        ddp = DDPStrategyConfig(name="zero", meta_init=cfg.meta_init)
        return Zero1Strategy(ddp, precision, list(cfg.block_classes) if cfg.block_classes else None)
    fsdp = FSDPStrategyConfig(
        name="zero",
        reshard_after_forward=cfg.stage == 3,
        block_classes=list(cfg.block_classes) if cfg.block_classes else None,
        meta_init=cfg.meta_init,
    )
    return FSDPStrategy(fsdp, precision)
