"""What the sweeper and its trials share: the study's storage, its pruner, and a trial's link to
both. The sweeper (on the driver) asks for points and tells results; each trial's rank 0 reports
the objective after every evaluation and asks whether to prune, and the ranks stop together."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import torch
import torch.distributed as dist

from dtf.config.schema import TrialConfig
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.sweep.settings import MOTPE_REMOVED

PRUNERS = ("none", "median", "asha", "hyperband")
JOURNAL_FILE = "optuna.journal"


def storage_spec(setting: str | None, sweep_dir: Path) -> str:
    """hydra.sweeper.storage as trials receive it: a journal file's absolute path, or a database URL."""
    if setting is None:
        return str((sweep_dir / JOURNAL_FILE).resolve())
    if "://" in setting:
        return setting
    return str(Path(setting).expanduser().resolve())


def open_storage(spec: str) -> optuna.storages.BaseStorage:
    """Optuna's journal file storage (appends and file locks only: fine on a shared file system
    that SLURM nodes or Spark executors also see), or its database storage for a URL."""
    if "://" in spec:
        return optuna.storages.RDBStorage(spec)
    from optuna.storages.journal import JournalFileBackend

    Path(spec).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(spec))


def build_pruner(name: str, options: Mapping[str, Any]) -> optuna.pruners.BasePruner:
    """none | median | asha | hyperband, with Optuna's own options (e.g. n_startup_trials, min_resource)."""
    kinds: dict[str, type[optuna.pruners.BasePruner]] = {
        "none": optuna.pruners.NopPruner,
        "median": optuna.pruners.MedianPruner,
        "asha": optuna.pruners.SuccessiveHalvingPruner,
        "hyperband": optuna.pruners.HyperbandPruner,
    }
    if name not in kinds:
        raise UserError(f"hydra.sweeper.pruner={name}: choose one of {', '.join(PRUNERS)}")
    try:
        return kinds[name](**dict(options))
    except TypeError as e:
        raise UserError(f"hydra.sweeper.pruner_options: {e} (options of {kinds[name].__name__})") from None


def build_sampler(config: Mapping[str, Any], seed: int | None, grid: Callable[[], dict[str, list[Any]]]) -> Any:
    """hydra.sweeper.sampler (the hydra/sweeper/sampler group: _target_ and the sampler's own
    options) as Optuna's sampler, seeded by seed; grid() gives a GridSampler its search space."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    options = {k: v for k, v in config.items() if v is not None or k == "seed"}
    target = str(options.get("_target_", ""))
    if target == MOTPE_REMOVED:
        raise UserError(
            "hydra/sweeper/sampler=motpe: the 'motpe' sampler was removed in Optuna 4.0: use hydra/sweeper/sampler=tpe "
            "(TPESampler takes several objectives)"
        )
    if "seed" in options:
        options["seed"] = seed
    try:
        if is_grid(config):
            options.pop("_partial_", None)
            return instantiate(options, search_space=grid())
        return instantiate(options)
    except InstantiationException as e:
        cause = " ".join(str(e.__cause__ or e).split())
        raise UserError(f"hydra.sweeper.sampler ({target or 'no _target_'}): {cause}") from None


def is_grid(sampler: Mapping[str, Any]) -> bool:
    """hydra/sweeper/sampler=grid (or a GridSampler by _target_): its grid is the search space's values."""
    return str(sampler.get("_target_", "")).rsplit(".", 1)[-1] == "GridSampler"


class TrialPruning:
    """One trial's side of pruning (every rank holds one; only rank 0 talks to the study)."""

    def __init__(self, cfg: TrialConfig, objective: str, env: DistEnv) -> None:
        self.objective = objective
        self.env = env
        self.trial: optuna.Trial | None = None
        if env.is_main:
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = optuna.load_study(
                study_name=cfg.study,
                storage=open_storage(cfg.storage),
                pruner=build_pruner(cfg.pruner, cfg.pruner_options),
            )
            self.trial = optuna.Trial(study, cfg.id)

    def should_prune(self, epoch: int, figures: Mapping[str, float | None]) -> bool:
        """Collective (all ranks, at the same epoch end): reports the objective of this epoch, if
        it has one, and returns the study pruner's answer, the same on every rank."""
        value = figures.get(self.objective)
        if value is None:  # no evaluation this epoch: the same on every rank (figures are global)
            return False
        prune = False
        if self.trial is not None:
            self.trial.report(value, epoch)
            prune = self.trial.should_prune()
        if dist.is_initialized() and self.env.world_size > 1:
            flag = torch.tensor([1.0 if prune else 0.0], device=self.env.device)
            dist.broadcast(flag, src=0)
            prune = bool(flag.item())
        return prune
