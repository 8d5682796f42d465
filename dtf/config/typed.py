"""A run's config as its components receive it: the sections dtf owns as dataclasses, the parts
users own as composed.

On the driver the composed config (an OmegaConf DictConfig, resolved and frozen) becomes one
RunConfig, once (dtf.preflight.validate): each dtf section a plain dataclass, built with
OmegaConf.to_object, which runs the dataclass's own checks (__post_init__). That RunConfig is what
the launchers pickle to the ranks and what every component receives; no rank types it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from dtf.config import schema
from dtf.errors import UserError

DataConfig = schema.LoaderDataConfig | schema.ParquetDataConfig | schema.TextDataConfig
StrategyConfig = (
    schema.DDPStrategyConfig | schema.ZeroStrategyConfig | schema.FSDPStrategyConfig | schema.AutoStrategyConfig
)
LauncherConfig = schema.LocalLauncherConfig | schema.SlurmLauncherConfig | schema.SparkLauncherConfig

STRATEGIES: dict[str, type] = {
    "ddp": schema.DDPStrategyConfig,
    "zero": schema.ZeroStrategyConfig,
    "fsdp": schema.FSDPStrategyConfig,
    "mics": schema.MicsStrategyConfig,
    "auto": schema.AutoStrategyConfig,
}
LAUNCHERS: dict[str, type] = {
    "local": schema.LocalLauncherConfig,
    "slurm": schema.SlurmLauncherConfig,
    "spark": schema.SparkLauncherConfig,
}
# kind petastorm: data=parquet by its former name.
DATA: dict[str, type] = {
    "loader": schema.LoaderDataConfig,
    "parquet": schema.ParquetDataConfig,
    "petastorm": schema.ParquetDataConfig,
    "text": schema.TextDataConfig,
}
# What a missing (???) value means to the user, where the generic sentence would not say enough.
MISSING_HINTS = {
    "data.path": "give the data to train on (Parquet; with data=text, text), e.g. data.path=data/train",
    "model.name_or_path": "give a folder that save_pretrained wrote, or a Hugging Face Hub id",
}


@dataclass(frozen=True)
class RunConfig:
    trainer: schema.TrainerConfig
    checkpoint: schema.CheckpointConfig
    data: DataConfig
    strategy: StrategyConfig
    launcher: LauncherConfig
    # Set on each trial by hydra/sweeper=dtf; None outside a search.
    trial: schema.TrialConfig | None
    # The loggers chosen (logger=[tensorboard,mlflow,csv]): name -> its settings, in the order chosen.
    loggers: dict[str, Any]
    # data.batch_size as the user configured it: the per-rank batch optimizer.lr is given for, and
    # (without data.global_batch_size) the batch of an elastic run's full size. data.batch_size is
    # the batch of this world size's ranks, once dtf.elastic.apply has fitted the run to it.
    configured_batch_size: int
    # The whole config as composed: what users own (model, optimizer, scheduler, loss, metrics) is
    # built from it by _target_ where it is used, and a run's record digests it.
    composed: DictConfig


def typed(cfg: DictConfig) -> RunConfig:
    """cfg as a RunConfig; a bad value is one line naming its key (UserError)."""
    data = section(cfg, "data", DATA[_data_kind(cfg.data)])
    return RunConfig(
        trainer=section(cfg, "trainer", schema.TrainerConfig),
        checkpoint=section(cfg, "checkpoint", schema.CheckpointConfig),
        data=data,
        strategy=section(cfg, "strategy", _by_name(cfg.strategy, STRATEGIES, "strategy")),
        launcher=section(cfg, "launcher", _by_name(cfg.launcher, LAUNCHERS, "launcher")),
        trial=section(cfg, "trial", schema.TrialConfig) if cfg.get("trial") is not None else None,
        loggers=loggers(cfg),
        configured_batch_size=data.batch_size,
        composed=cfg,
    )


def loggers(cfg: DictConfig) -> dict[str, Any]:
    """The logger group's choices, each as its dataclass (none: logger=[])."""
    node = cfg.get("logger")
    if node is None:
        return {}
    if not isinstance(node, DictConfig):
        raise UserError(f"logger={node} is not a choice of loggers: e.g. logger=[tensorboard,mlflow,csv]")
    chosen: dict[str, Any] = {}
    for name in map(str, node):
        if name not in schema.LOGGERS:
            raise UserError(
                f"logger.{name} is not one of dtf's loggers: choose among {', '.join(schema.LOGGERS)}, "
                "e.g. logger=[tensorboard,mlflow]"
            )
        chosen[name] = section(node, name, schema.LOGGERS[name], prefix="logger.")
    return chosen


def _data_kind(data: DictConfig) -> str:
    kind = data.get("kind") if "kind" in data else None
    if kind == "text":
        return "text"
    parquet = kind in ("parquet", "petastorm") or (kind is None and "path" in data.keys())  # noqa: SIM118 (a path still ??? too)
    return "parquet" if parquet else "loader"


def _by_name(node: DictConfig, classes: dict[str, type], key: str) -> type:
    name = node.get("name")
    if name not in classes:
        raise UserError(f"{key}.name={name} is not one of dtf's {key}s: choose {', '.join(classes)}")
    return classes[name]


def section(cfg: DictConfig, key: str, cls: type, prefix: str = "") -> Any:
    """cfg[key] as a cls instance: as composed from dtf's schema, or merged onto it (a user's own
    option that does not extend the schema still gets its defaults and checks). prefix: where cfg
    sits in the whole config, for the messages ("logger.")."""
    node = cfg[key]
    key = prefix + key
    try:
        if OmegaConf.get_type(node) is not cls:
            node = OmegaConf.merge(OmegaConf.structured(cls), node)
        return OmegaConf.to_object(node)
    except MissingMandatoryValue as e:
        full = f"{key}.{e.full_key}" if e.full_key and not str(e.full_key).startswith(key) else str(e.full_key or key)
        raise UserError(f"{full} is not set: {MISSING_HINTS.get(full, f'give it a value, e.g. {full}=...')}") from None
    except OmegaConfBaseException as e:
        raise UserError(f"{key}: {str(e).splitlines()[0]}") from None
