"""Reference models of the seed scenarios, and how a config's model section becomes a module."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

_FOR_SHARDS = contextvars.ContextVar("dtf_building_for_shards", default=False)


def build_model(cfg: DictConfig) -> nn.Module:
    """One module by _target_, or a mapping of names to module configs (several modules, as in a GAN)."""
    if "_target_" in cfg:
        return instantiate(cfg)
    return nn.ModuleDict({str(name): instantiate(sub) for name, sub in cfg.items()})


@contextlib.contextmanager
def for_shards() -> Iterator[None]:
    """Where a strategy that shards the parameters builds the model (dtf.strategy.fsdp). A model
    whose weights come from files (model=hf) then builds on the meta device, whatever
    strategy.meta_init says, and loads them into the shards once they exist: no rank but the one
    that reads the files ever holds them whole. Other models ignore it."""
    token = _FOR_SHARDS.set(True)
    try:
        yield
    finally:
        _FOR_SHARDS.reset(token)


def building_for_shards() -> bool:
    """Whether the model being built is for a strategy that shards its parameters (for_shards)."""
    return _FOR_SHARDS.get()
