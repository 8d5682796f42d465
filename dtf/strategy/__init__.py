"""Strategies by name: `strategy.name` in the config picks the class."""

from __future__ import annotations

from omegaconf import DictConfig

from dtf.strategy.base import Strategy
from dtf.strategy.ddp import DDPStrategy

REGISTRY: dict[str, type[Strategy]] = {
    "ddp": DDPStrategy,
}


def build(cfg: DictConfig) -> Strategy:
    return REGISTRY[cfg.name](cfg)
