"""Registers dtf's schemas in Hydra's ConfigStore; option YAMLs extend them by name."""

from hydra.core.config_store import ConfigStore

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


def register() -> None:
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(name=name, node=node)
