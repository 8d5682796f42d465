"""The settings of hydra/sweeper=dtf (`hydra.sweeper.*`). Standard library only: Hydra imports
this with its plugins at every start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SweeperSettings:
    _target_: str = "hydra_plugins.dtf_sweeper.dtf_sweeper.DtfSweeper"
    # Trials in all, counting those an earlier, interrupted run of the same sweep finished.
    n_trials: int = 8
    # Trials running at once; a new one starts as soon as one ends or is pruned.
    parallel: int = 1
    # none | median | asha | hyperband (Optuna's NopPruner, MedianPruner,
    # SuccessiveHalvingPruner, HyperbandPruner); pruner_options are passed to it.
    pruner: str = "none"
    pruner_options: dict[str, Any] = field(default_factory=dict)
    # tpe | random (Optuna's TPESampler, RandomSampler), seeded by seed.
    sampler: str = "tpe"
    seed: int | None = 0
    # The search space in Hydra's override syntax, e.g. optimizer.lr: tag(log, interval(1e-4, 1e-1)).
    # Sweep overrides on the command line join it.
    params: dict[str, str] = field(default_factory=dict)
    # Where the study lives: null = Optuna's journal file <sweep dir>/optuna.journal (on any file
    # system every trial can reach); a path = a journal file there; a URL (sqlite:///...,
    # postgresql://...) = that database.
    storage: str | None = None
    study_name: str = "dtf"
