"""Launchers by name: `launcher.name` in the config picks the class."""

from __future__ import annotations

from dtf.config.typed import RunConfig
from dtf.launch.base import Launcher
from dtf.launch.local import LocalLauncher
from dtf.launch.slurm import SlurmLauncher
from dtf.launch.spark import SparkLauncher

REGISTRY: dict[str, type[Launcher]] = {
    "local": LocalLauncher,
    "slurm": SlurmLauncher,
    "spark": SparkLauncher,
}


def build(run: RunConfig) -> Launcher:
    return REGISTRY[run.launcher.name](run.launcher, run.checkpoint)
