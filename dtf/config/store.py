"""Registers dtf's schemas in Hydra's ConfigStore (option YAMLs extend them by name) and the
`dtf_stamp` resolver of the default run directory. conf/__init__.py calls register(), so
that composing dtf's tree works however it is reached: `python -m dtf`, Hydra's compose API
(`initialize_config_module("dtf.conf")`), or a user's tree that puts dtf's on its search path."""

from __future__ import annotations

import os
from datetime import datetime

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from dtf.config import schema

# Stored outside any group, so that they are not offered as options of `trainer`, `data`, ...
# (nor listed by --help); an option YAML extends one with `- /<name>@_here_` in its defaults.
SCHEMAS = {
    "schema_trainer": schema.TrainerConfig,
    "schema_checkpoint": schema.CheckpointConfig,
    "schema_data_loader": schema.LoaderDataConfig,
    "schema_data_petastorm": schema.PetastormDataConfig,
    "schema_strategy_ddp": schema.DDPStrategyConfig,
    "schema_strategy_zero": schema.ZeroStrategyConfig,
    "schema_strategy_fsdp": schema.FSDPStrategyConfig,
    "schema_strategy_mics": schema.MicsStrategyConfig,
    "schema_launcher_local": schema.LocalLauncherConfig,
    "schema_launcher_slurm": schema.SlurmLauncherConfig,
    "schema_launcher_spark": schema.SparkLauncherConfig,
}


def run_stamp() -> str:
    """The default run directory's name: a timestamp, or under an external torchrun (or srun)
    the run id (job and step) that all its ranks share, so they agree on one directory."""
    if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
        return f"torchrun/{os.environ['TORCHELASTIC_RUN_ID']}"
    if "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ:  # tasks of one srun: one directory
        return f"slurm/{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")


def register() -> None:
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(name=name, node=node)
    OmegaConf.register_new_resolver("dtf_stamp", run_stamp, use_cache=True, replace=True)
