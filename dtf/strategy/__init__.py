"""Strategies by name: `strategy.name` in the config picks the class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dtf.config.typed import StrategyConfig
from dtf.strategy.base import Strategy
from dtf.strategy.ddp import DDPStrategy
from dtf.strategy.fsdp import FSDPStrategy
from dtf.strategy.mics import MicsStrategy
from dtf.strategy.zero import zero

REGISTRY: dict[str, Callable[[Any, str], Strategy]] = {
    "ddp": DDPStrategy,
    "zero": zero,
    "fsdp": FSDPStrategy,
    "mics": MicsStrategy,
}


def build(cfg: StrategyConfig, precision: str = "32") -> Strategy:
    return REGISTRY[cfg.name](cfg, precision)
