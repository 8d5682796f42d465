"""A launcher starts the ranks of one run and returns rank 0's result."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

# worker_main(cfg, run_dir) -> rank 0's summary (None on other ranks)
WorkerFn = Callable[[DictConfig, str], Any]


class Launcher(ABC):
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def launch(self, fn: WorkerFn, cfg: DictConfig, run_dir: str) -> Any:
        """Run fn(cfg, run_dir) on every rank; return rank 0's result or raise RankFailedError."""
