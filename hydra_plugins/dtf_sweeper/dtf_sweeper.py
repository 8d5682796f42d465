"""Hydra finds sweepers only in the hydra_plugins namespace: this module registers
`hydra/sweeper=dtf` and hands the work to dtf.sweep (imported only when a sweep starts)."""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from dtf.sweep.settings import SweeperSettings


class DtfSweeper(Sweeper):
    """Trials side by side (`parallel`), suggested by Optuna and pruned while they train."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config

    def sweep(self, arguments: list[str]) -> Any:
        from dtf.sweep.sweeper import run_sweep

        assert self.config is not None
        return run_sweep(self.settings, self.config, arguments)


ConfigStore.instance().store(group="hydra/sweeper", name="dtf", node=SweeperSettings, provider="dtf")
