"""Hydra finds sweepers only in the hydra_plugins namespace: this module registers
`hydra/sweeper=dtf` and its sampler group, and hands the work to dtf.sweep (imported only when a
sweep starts)."""

from __future__ import annotations

import importlib.util
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from dtf.sweep.settings import SAMPLERS, SweeperSettings


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
# hydra-optuna-sweeper stores the same group (hydra/sweeper/sampler) with the same targets; where it
# is installed (its own venv, dtf.sideenv) its options stand, for both sweepers, untouched by dtf's.
if importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None:
    for name, node in SAMPLERS.items():
        ConfigStore.instance().store(group="hydra/sweeper/sampler", name=name, node=node, provider="dtf")
