"""The settings of hydra/sweeper=dtf (`hydra.sweeper.*`) and its sampler group
(`hydra/sweeper/sampler=tpe|random|grid|cmaes|nsgaii|qmc|gp`): hydra-optuna-sweeper's config
surface, with its meaning, plus what only dtf has (pruning, `parallel`). Standard library only:
Hydra imports this with its plugins at every start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MISSING = "???"  # omegaconf.MISSING


# The sampler group, as hydra-optuna-sweeper's config.py has it (for Optuna 4 and later): one
# dataclass per Optuna sampler, `_target_` the sampler's class and the rest its keyword arguments.
@dataclass
class TPESamplerConfig:
    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = None
    consider_prior: bool | None = None
    prior_weight: float | None = None
    consider_magic_clip: bool | None = None
    consider_endpoints: bool | None = None
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: bool = False
    warn_independent_sampling: bool | None = None


@dataclass
class RandomSamplerConfig:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: int | None = None


@dataclass
class GridSamplerConfig:
    # The grid is every value of hydra.sweeper.params (choices, ranges); n_trials at most its size.
    _target_: str = "optuna.samplers.GridSampler"
    _partial_: bool = True
    seed: int | None = None


@dataclass
class CmaEsSamplerConfig:
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: int | None = None
    x0: dict[str, Any] | None = None
    sigma0: float | None = None
    independent_sampler: Any = None
    warn_independent_sampling: bool = True
    consider_pruned_trials: bool = False
    restart_strategy: Any = None
    inc_popsize: int = 2
    use_separable_cma: bool = False
    source_trials: Any = None


@dataclass
class NSGAIISamplerConfig:
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: int | None = None
    population_size: int = 50
    mutation_prob: float | None = None
    crossover_prob: float = 0.9
    swapping_prob: float = 0.5
    constraints_func: Any = None


@dataclass
class QMCSamplerConfig:
    _target_: str = "optuna.samplers.QMCSampler"
    seed: int | None = None
    qmc_type: str = "sobol"
    scramble: bool = False
    independent_sampler: Any = None
    warn_asynchronous_seeding: bool = True
    warn_independent_sampling: bool = True


@dataclass
class GPSamplerConfig:
    _target_: str = "optuna.samplers.GPSampler"
    seed: int | None = None
    independent_sampler: Any = None
    n_startup_trials: int = 10
    deterministic_objective: bool = False
    constraints_func: Any = None
    warn_independent_sampling: bool = True


MOTPE_REMOVED = "dtf.sweep.refused.motpe"  # not a callable: dtf.sweep.study refuses it by this name


@dataclass
class MOTPESamplerConfig:
    # Optuna 4 removed MOTPESampler: refused in one line (TPESampler takes several objectives).
    _target_: str = MOTPE_REMOVED
    seed: int | None = None


SAMPLERS: dict[str, type] = {
    "tpe": TPESamplerConfig,
    "random": RandomSamplerConfig,
    "grid": GridSamplerConfig,
    "cmaes": CmaEsSamplerConfig,
    "nsgaii": NSGAIISamplerConfig,
    "qmc": QMCSamplerConfig,
    "gp": GPSamplerConfig,
    "motpe": MOTPESamplerConfig,
}


@dataclass
class SweeperSettings:
    _target_: str = "hydra_plugins.dtf_sweeper.dtf_sweeper.DtfSweeper"
    # The sweeper builds the sampler itself (a continued search reseeds it), so Hydra passes configs.
    _recursive_: bool = False
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    # hydra/sweeper/sampler=<name>, its options under hydra.sweeper.sampler (seed among them).
    sampler: Any = MISSING
    # minimize | maximize, or a list of them: several objectives (trainer.objective a list of as
    # many metric names), a Pareto front. null: as trainer.objective_mode says.
    direction: Any = None
    # Trials in all, counting those an earlier, interrupted run of the same sweep finished.
    n_trials: int = 8
    # Trials running at once (null: 1); a new one starts as soon as one ends or is pruned.
    # n_jobs is hydra-optuna-sweeper's name for the same number.
    parallel: int | None = None
    n_jobs: int | None = None
    # The sweep stops once more than this fraction of its finished trials failed (null: never).
    max_failure_rate: float | None = None
    # none | median | asha | hyperband (Optuna's NopPruner, MedianPruner,
    # SuccessiveHalvingPruner, HyperbandPruner); pruner_options are passed to it.
    pruner: str = "none"
    pruner_options: dict[str, Any] = field(default_factory=dict)
    # The search space in Hydra's override syntax, e.g. optimizer.lr: tag(log, interval(1e-4, 1e-1)).
    # Sweep overrides on the command line join it.
    params: dict[str, str] | None = None
    # hydra-optuna-sweeper 1.2's former search space: key -> {type: int|float|categorical, low,
    # high, log, step, choices}. Used only without params, with a warning.
    search_space: dict[str, Any] | None = None
    # A function (module.name) called as fn(cfg, trial) after the params are suggested, to
    # suggest more with Optuna's trial.suggest_* (each becomes an override key=value).
    custom_search_space: str | None = None
    # Where the study lives: null = Optuna's journal file <sweep dir>/optuna.journal (on any file
    # system every trial can reach); a path = a journal file there; a URL (sqlite:///...,
    # postgresql://...) = that database.
    storage: str | None = None
    study_name: str | None = None  # null: dtf
