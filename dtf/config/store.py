"""Registers dtf's schemas in Hydra's ConfigStore; option YAMLs extend them by name."""

from hydra.core.config_store import ConfigStore

from dtf.config import schema

# Kept in their own group, so that they do not show up as options of `trainer`, `data`, ...;
# an option YAML extends one with `- /schema/<group>/<name>@_here_` in its defaults list.
SCHEMAS = {
    ("schema/trainer", "trainer"): schema.TrainerConfig,
    ("schema/data", "loader"): schema.LoaderDataConfig,
    ("schema/strategy", "ddp"): schema.DDPStrategyConfig,
    ("schema/launcher", "local"): schema.LocalLauncherConfig,
}


def register() -> None:
    cs = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)
