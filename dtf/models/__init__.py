"""Reference models of the seed scenarios, and how a config's model section becomes a module."""

from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn


def build_model(cfg: DictConfig) -> nn.Module:
    """One module by _target_, or a mapping of names to module configs (several modules, as in a GAN)."""
    if "_target_" in cfg:
        return instantiate(cfg)
    return nn.ModuleDict({str(name): instantiate(sub) for name, sub in cfg.items()})
