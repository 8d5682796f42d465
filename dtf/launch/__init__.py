"""Launchers by name: `launcher.name` in the config picks the class."""

from __future__ import annotations

from typing import Any

from dtf.config.typed import RunConfig
from dtf.dist.env import launched_externally
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


def driver_holds_run_dir(launcher: Any) -> bool:
    """Whether the driver holds the run dir for the run (dtf.rundir): where it lives as long as the
    ranks do, on their machine or one that shares their run dir: local ranks of one node, a Spark
    stage. Elsewhere rank 0 holds it: a SLURM job runs (and is requeued) without its driver, the
    nodes of a multi-node run each have one, and under torchrun every rank is its own driver.
    launcher: its config section, typed or as composed."""
    if launched_externally():
        return False
    if launcher.name == "spark":
        return True
    return bool(launcher.name == "local" and str(launcher.nnodes).split(":")[-1] == "1")
