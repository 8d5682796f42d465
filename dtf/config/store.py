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
    "schema_data_parquet": schema.ParquetDataConfig,
    "schema_data_petastorm": schema.ParquetDataConfig,  # the former name, for users' option YAMLs
    "schema_data_text": schema.TextDataConfig,
    "schema_strategy_ddp": schema.DDPStrategyConfig,
    "schema_strategy_zero": schema.ZeroStrategyConfig,
    "schema_strategy_fsdp": schema.FSDPStrategyConfig,
    "schema_strategy_mics": schema.MicsStrategyConfig,
    "schema_strategy_auto": schema.AutoStrategyConfig,
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
    register_recipes(cs)
    OmegaConf.register_new_resolver("dtf_stamp", run_stamp, use_cache=True, replace=True)


def recipe_names() -> list[str]:
    """The recipes: recipes/<name>.yaml at the repository's top, the package dtf.recipes once installed."""
    from importlib.resources import files

    return sorted(p.name.removesuffix(".yaml") for p in files("dtf.recipes").iterdir() if p.name.endswith(".yaml"))


def register_recipes(cs: ConfigStore) -> None:
    """Each recipe is the option <name> of the group `recipe` (+recipe=<name>), a global config as
    an experiment is. They are stored here rather than found on the search path because the
    recipes live beside conf/, not in it, and a search path entry would have to name a directory
    with a `recipe/` folder inside, which neither a checkout nor the wheel has."""
    from importlib.resources import files

    for name in recipe_names():
        node = OmegaConf.create((files("dtf.recipes") / f"{name}.yaml").read_text())
        cs.store(group="recipe", name=name, node=node, package="_global_")
