"""Where rank 0 logs a run: the logger group (conf/logger/), one module per backend behind one
protocol, and the fan-out the trainer calls. Only rank 0 builds loggers, so no other rank imports
a logger's package; each backend's package is imported when its logger starts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Protocol

from dtf.errors import UserError

# The package each logger needs, and the extra of dtf that installs it.
PACKAGES = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}


class Logger(Protocol):
    def start(self, state: Any) -> None:
        """Before the first step, after a resume (state: the TrainState, whose run ids it keeps)."""

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float | None]) -> None:
        """At the end: the run's main settings and its final figures."""

    def finish(self, run_dir: Path) -> None:
        """At the end, once summary.json and model.pt are written: the run's files, where kept."""

    def close(self, status: str) -> None:
        """status: finished, pruned (by its search, after finishing), stopped (a stop signal; the run
        resumes later) or failed."""


class Loggers:
    """Every chosen logger, called in turn (none on ranks other than 0)."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers

    def start(self, state: Any) -> None:
        for logger in self.loggers:
            logger.start(state)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for logger in self.loggers:
            logger.scalars(step, values)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float | None]) -> None:
        for logger in self.loggers:
            logger.hparams(hparams, metrics)

    def finish(self, run_dir: Path) -> None:
        for logger in self.loggers:
            logger.finish(run_dir)

    def close(self, status: str = "finished") -> None:
        for logger in self.loggers:
            logger.close(status)


def build(run: Any, run_dir: Path, is_main: bool, world_size: int) -> Loggers:
    """The loggers run.loggers chooses, on rank 0 (trainer.tensorboard=false leaves TensorBoard out)."""
    if not is_main:
        return Loggers([])
    loggers: list[Logger] = []
    for name, settings in run.loggers.items():
        if name == "tensorboard" and run.trainer.tensorboard:
            from dtf.train.loggers.tensorboard import TensorBoard

            loggers.append(TensorBoard(run_dir))
        elif name == "csv":
            from dtf.train.loggers.csv import CsvLogger

            loggers.append(CsvLogger(run_dir / settings.file))
        elif name == "mlflow":
            from dtf.train.loggers.mlflow import MlflowLogger

            loggers.append(MlflowLogger(settings, run, run_dir, world_size))
        elif name == "wandb":
            from dtf.train.loggers.wandb import WandbLogger

            loggers.append(WandbLogger(settings, run, run_dir, world_size))
    return Loggers(loggers)


def require_package(logger: str) -> None:
    """One line naming the extra to install, where a chosen logger's package is missing."""
    if logger not in PACKAGES:
        return
    package, extra = PACKAGES[logger]
    if importlib.util.find_spec(package) is None:
        raise UserError(
            f"logger={logger} needs the {package} package, which is not installed: pip install 'dtf[{extra}]' "
            f"(or leave {logger} out of logger=[...])"
        )


def flat_config(node: Any, prefix: str = "") -> dict[str, str]:
    """A resolved config (as plain containers) as flat `section.key` -> str(value), as mlflow.log_params
    writes values (an empty section has none)."""
    if isinstance(node, dict):
        flat: dict[str, str] = {}
        for key, value in node.items():
            flat.update(flat_config(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): str(node)}
