"""The driver's pre-flight: what can be checked over the whole stack before any rank starts. Rules
that span sections or look at the machine, the Parquet data's metadata, and the `_target_`s.
Each section's own values are checked by its dataclass (dtf.config.schema, through
dtf.config.typed). The command line (dtf.cli) and the Python API (dtf.api) call it.

Every failure is a UserError whose message names the key and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dtf import remote
from dtf.config.keys import SECTIONS, section_key_hint, unknown_top_level_line
from dtf.config.schema import (
    AutoStrategyConfig,
    CheckpointConfig,
    LocalLauncherConfig,
    MemoryCheck,
    MicsStrategyConfig,
    OnError,
    ParquetDataConfig,
    SlurmLauncherConfig,
    TextDataConfig,
    TrainerConfig,
)
from dtf.config.targets import check_target, targets
from dtf.config.typed import MISSING_HINTS, LauncherConfig, RunConfig, typed
from dtf.dist import env as dist_env
from dtf.errors import UserError, require, user_error_in

# The sections trainer=function never reads (the function builds its own), and what they are.
NOT_READ_BY_FUNCTIONS = {
    "optimizer": "optimizer",
    "scheduler": "learning-rate schedule",
    "loss": "loss",
    "metrics": "metrics",
}


# The trainer keys only the Trainer's loop reads (trainer.progress is left alone: a display setting
# a user gives every run, which a function run's own lines do not need).
LOOP_ONLY_TRAINER_KEYS = frozenset(
    {
        "max_epochs",
        "max_steps",
        "grad_accum_steps",
        "grad_clip_norm",
        "lr_scaling",
        "warmup_steps",
        "warmup_start_factor",
        "deterministic",
        "eval_every_n_epochs",
        "eval_every_n_steps",
        "train_metrics",
        "log_every_n_steps",
        "step_fn",
        "num_warmup_timing_steps",
        "compile",
        "activation_checkpointing",
        "on_nonfinite",
        "early_stopping",
        "limit_train_batches",
        "limit_eval_batches",
        "overfit_batches",
        "profiler",
    }
)
_FOR_YOUR_FUNCTION = (
    "settings for your function go in trainer.hparams (+trainer.hparams.lr=0.01 reaches it as hparams['lr'])"
)


def refuse_unread_by_function(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """trainer=function composes the sections the Trainer reads (their defaults) but never reads
    them, nor the loop's trainer keys: a setting of one the user gave (overrides: the command line's,
    run_function's) would be ignored, so it is refused in one line. The defaults themselves are
    not the user's to remove."""
    if cfg.trainer.get("fn") is None:
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(list(overrides)):
        section, *rest = override.key_or_group.split("@")[0].split(".")
        if section in NOT_READ_BY_FUNCTIONS:
            raise UserError(
                f"{override.input_line}: trainer=function does not use the {section} section (your function builds "
                f"its own {NOT_READ_BY_FUNCTIONS[section]}): remove it; {_FOR_YOUR_FUNCTION}"
            )
        if section == "trainer" and rest and rest[0] in LOOP_ONLY_TRAINER_KEYS:
            raise UserError(
                f"{override.input_line}: trainer=function does not use trainer.{rest[0]} (the Trainer's loop reads "
                f"it; your function runs its own loop): remove it; {_FOR_YOUR_FUNCTION}"
            )


def validate(cfg: DictConfig, starting: bool = False) -> RunConfig:
    """Refuse a bad config in one line, before any process starts; returns it typed. starting: a
    run starts now, and the metrics' classes may be left to its ranks if they start here at once
    (check_metric_classes); else every check is made here."""
    for key in map(str, cfg):
        if key not in SECTIONS:
            raise UserError(unknown_top_level_line(key))
    for section in ("trainer", "data", "strategy", "launcher", "checkpoint"):
        _check_known_keys(cfg[section], section)
    run = typed(cfg)  # each section checks its own values
    run = _check_sizes(run)
    _check_machine(run.trainer)
    _check_stop_signal(run)
    _check_gpus(run)
    _check_resume(run.checkpoint)
    _check_loggers(run)
    if isinstance(run.data, ParquetDataConfig):
        from dtf.data.parquet.source import open_sources  # pyarrow: only for runs that read Parquet

        # From the Parquet metadata only: files readable, columns present, a full batch for every rank.
        open_sources(run.data, expected_world_size(run.launcher))
        check_canonical_partitions(run, None)
    if isinstance(run.data, TextDataConfig):
        from dtf.data.parquet.source import open_sources
        from dtf.data.text import parquet_view, prepare

        # The text is tokenized here, once, before any rank starts; the ranks find it done.
        open_sources(parquet_view(run.data, prepare(run.data)), expected_world_size(run.launcher))
        check_canonical_partitions(run, None)
    _check_strategy(run)
    metric_classes = not (starting and isinstance(run.launcher, LocalLauncherConfig))
    _check_metrics(run, classes=metric_classes)
    _check_performance_switches(run)
    lr = cfg.optimizer.get("lr") if isinstance(cfg.optimizer, DictConfig) else None
    if lr is not None:
        require(
            isinstance(lr, int | float) and lr > 0,
            "optimizer.lr",
            lr,
            "give a positive learning rate, e.g. optimizer.lr=1e-3",
        )
    fn = run.trainer.fn
    if fn is not None and fn.get("_target_") is None:  # trainer=function as it comes
        raise UserError(
            "trainer.fn._target_ is not set: name your training function, e.g. trainer.fn._target_=mypkg.train "
            "(called on every rank as fn(module, hparams, train_set, test_set))"
        )
    for section in ("model", "optimizer", "scheduler", "loss", "data", "trainer"):  # metrics: _check_metrics
        node = cfg.get(section)
        if node is not None:
            for path, target_node in targets(node, section):
                check_target(path, target_node)
    if run.trainer.fn is None:  # a model that refuses its settings (model=hf's folder, Auto class) does so here
        _meta_model(run)
    _check_memory(run)  # last: it builds the model (on the meta device) from what is checked above
    return run


def _check_sizes(run: RunConfig) -> RunConfig:
    """The world sizes a run may take keep its global batch (dtf.elastic); where the size is
    known, the run is returned as its ranks will take it, so that the checks below see each
    rank's batch."""
    from dtf import elastic

    launcher = run.launcher
    if isinstance(launcher, LocalLauncherConfig):
        elastic.rdzv_configs(launcher.rdzv_configs)
        if launcher.rdzv_configs and launcher.node_range() == (1, 1):
            raise UserError(
                f"launcher.rdzv_configs.{next(iter(launcher.rdzv_configs))}: the rendezvous settings have no "
                "effect on one node (launcher.nnodes=1): remove them, or give launcher.nnodes=N or MIN:MAX"
            )
    if isinstance(launcher, SlurmLauncherConfig):
        elastic.rdzv_configs(launcher.rdzv_configs)
        if launcher.rdzv_configs and not launcher.elastic:
            raise UserError(
                f"launcher.rdzv_configs.{next(iter(launcher.rdzv_configs))}: a SLURM job of a fixed size has no "
                "rendezvous (SLURM starts its ranks): remove it, or give launcher.nodes=MIN:MAX"
            )
    world = expected_world_size(run.launcher)
    if elastic.plan(run, world if dist_env.launched_externally() else None) is not None and world is not None:
        return elastic.apply(run, world)
    return run


def _check_known_keys(node: DictConfig, section: str) -> None:
    """Hydra lets `+section.key=...` add a key to a schema'd node; dtf would silently ignore it."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    fields = {f.name for f in dataclasses.fields(schema)}
    for key in map(str, node):
        if key not in fields:
            hint = section_key_hint(section, key, fields)
            raise UserError(f"{section}.{key} is not a setting of dtf's {section} ({hint}); remove +{section}.{key}")


def check_canonical_partitions(run: RunConfig, run_dir: Path | None) -> None:
    """Parquet's canonical partitions against the world size and the global batch, where the
    driver knows the world size: the ones asked for, or those of the checkpoint the run resumes
    from (run_dir: where checkpoint.resume=auto looks; None: not known yet)."""
    if not isinstance(run.data, ParquetDataConfig | TextDataConfig):
        return
    world = expected_world_size(run.launcher)
    if world is None:
        return  # elastic: the ranks check it once they meet
    from dtf.data.parquet.plan import choose_partitions

    choose_partitions(
        run.data.canonical_partitions, _recorded_partitions(run.checkpoint, run_dir), world, run.data.batch_size
    )


def _recorded_partitions(c: CheckpointConfig, run_dir: Path | None) -> int | None:
    """The canonical partitions recorded in the checkpoint this run will resume from, if known."""
    from dtf.train.checkpoint import recorded_position, scan
    from dtf.train.checkpoint_store import checkpoint_root, location

    if c.resume == "never":
        return None
    if c.resume == "auto":
        found = scan(checkpoint_root(run_dir, c.dir, c.storage_options))[0] if run_dir is not None else []
        path = found[0] if found else None
    else:
        path = location(c.resume, c.storage_options, "checkpoint.resume")
    if path is None:
        return None
    try:
        return recorded_position(path).canonical_partitions
    except Exception:  # unreadable: the ranks skip or refuse that checkpoint with a reason
        return None


def _check_loggers(run: RunConfig) -> None:
    """Each chosen logger's package is installed, and a tracking server answers, before any rank starts."""
    from dtf.train.loggers import require_package

    for name in run.loggers:
        require_package(name)
    mlflow = run.loggers.get("mlflow")
    if mlflow is not None:
        tracking_server_answers(
            mlflow, "train", "training goes on, and rank 0 tries MLflow once more when training starts"
        )


def tracking_server_answers(mlflow: Any, doing: str, without: str) -> bool:
    """Whether logger.mlflow's tracking server answers (True also where it is no server). One that does
    not: UserError, or with logger.mlflow.on_error=warn a warning that says what happens `without` it."""
    from dtf.train.loggers.mlflow import configured_uri

    uri = configured_uri(mlflow)
    problem = tracking_server_problem(uri, float(mlflow.timeout_s))
    if problem is None:
        return True
    where = "logger.mlflow.tracking_uri" if mlflow.tracking_uri else "MLFLOW_TRACKING_URI"
    if mlflow.on_error == OnError.fail:
        raise UserError(
            f"{where}={uri}: the MLflow tracking server cannot be reached ({problem}): start it, give another "
            f"URI, or {doing} without it: logger.mlflow.on_error=warn"
        )
    print(
        f"dtf: warning: {where}={uri}: the MLflow tracking server cannot be reached ({problem}); {without} "
        "(logger.mlflow.on_error=warn)",
        flush=True,
    )
    return False


def tracking_server_problem(uri: str, timeout_s: float) -> str | None:
    """Why an http(s) tracking URI does not answer MLflow's /health (None: it does, or it is no server)."""
    if not uri.startswith(("http://", "https://")):
        return None  # a file store or a database: MLflow makes it where it is missing
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s) as response:
            if response.status == 200:
                return None
            return f"/health answered HTTP {response.status}"
    except urllib.error.HTTPError as e:
        return f"/health answered HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return " ".join(str(reason).split())


def _check_machine(t: TrainerConfig) -> None:
    """What the trainer asks of this machine."""
    if t.device == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is visible: use trainer.device=auto or cpu")
    if t.dist_backend == "nccl" and (t.device == "cpu" or not torch.cuda.is_available()):
        raise UserError("trainer.dist_backend=nccl needs CUDA devices: use trainer.dist_backend=auto or gloo")


def _check_stop_signal(run: RunConfig) -> None:
    """SLURM's warning signal must be one the ranks handle, or it kills them instead of saving."""
    if isinstance(run.launcher, SlurmLauncherConfig):
        signals = run.checkpoint.stop_signals
        require(
            run.launcher.signal in signals,
            "launcher.signal",
            run.launcher.signal,
            f"it must be one of checkpoint.stop_signals ({', '.join(signals)}), or the ranks "
            "would die of it instead of saving",
        )


def _check_resume(c: CheckpointConfig) -> None:
    if c.storage_options and not (remote.is_remote(c.dir) or remote.is_remote(c.resume)):
        raise UserError(
            f"checkpoint.storage_options={dict(c.storage_options)} are for a URL (s3://...) in "
            f"checkpoint.dir or checkpoint.resume, and both name local folders ({c.dir}, {c.resume}): "
            "leave them out, or give checkpoint.dir a URL"
        )
    if remote.is_remote(c.dir):  # a store that cannot be listed, or that holds what is not dtf's, is refused
        from dtf.train.checkpoint_store import RemotePath, check_store

        check_store(RemotePath(c.dir, c.storage_options))
    if c.resume not in ("auto", "never"):
        from dtf.train.checkpoint import resolve_resume  # torch.distributed.checkpoint: only when needed
        from dtf.train.checkpoint_store import location

        # a named checkpoint must exist and be complete
        resolve_resume(c.resume, location(c.resume, c.storage_options, "checkpoint.resume"), c.storage_options)


def _check_gpus(run: RunConfig) -> None:
    """One GPU per rank (each rank pins the GPU of its local rank): more ranks per machine than GPUs
    would put two ranks on one GPU, which NCCL refuses in the middle of the start-up."""
    launcher = run.launcher
    if run.trainer.device == "cpu":
        return
    if isinstance(launcher, SlurmLauncherConfig):  # the nodes' GPUs, as asked for
        gpus = launcher.gpus_per_node
        if gpus and launcher.tasks_per_node > gpus:
            raise UserError(
                f"launcher.tasks_per_node={launcher.tasks_per_node} is more than launcher.gpus_per_node={gpus} "
                "GPUs: every rank needs a GPU of its own; lower launcher.tasks_per_node or raise launcher.gpus_per_node"
            )
    if isinstance(launcher, LocalLauncherConfig) and not dist_env.launched_externally() and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if launcher.nproc > visible:
            raise UserError(
                f"launcher.nproc={launcher.nproc} is more than the {visible} GPU(s) visible here: every rank needs "
                f"a GPU of its own; use launcher.nproc={visible} or fewer, or trainer.device=cpu"
            )


def expected_world_size(launcher: LauncherConfig) -> int | None:
    """The number of ranks the launcher will start, when the driver can know it."""
    if dist_env.launched_externally():
        return int(os.environ["WORLD_SIZE"])
    if isinstance(launcher, LocalLauncherConfig):
        low, high = launcher.node_range()
        return launcher.nproc * low if low == high else None  # elastic: known once the nodes meet
    if isinstance(launcher, SlurmLauncherConfig) and launcher.elastic:
        return None
    return launcher.nproc


def _check_strategy(run: RunConfig) -> None:
    s = run.strategy
    if isinstance(s, AutoStrategyConfig) and run.trainer.fn is not None:
        raise UserError(
            "strategy=auto chooses by the model's size, and a trainer=function run builds its own models: name a "
            "strategy (strategy=ddp, zero, fsdp, or mics, whose partition_group_size=auto needs no model)"
        )
    if isinstance(s, MicsStrategyConfig) and s.partition_group_size != "auto":
        group, world = s.partition_group_size, expected_world_size(run.launcher)
        if world is not None and world % group != 0:
            valid = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
            how = "is larger than" if group > world else "does not divide"
            raise UserError(
                f"strategy.partition_group_size={group} {how} the world size {world}: use one of {valid}, or auto"
            )
        if s.cross_group_dtype != "float32" and world == group:
            raise UserError(
                f"strategy.cross_group_dtype={s.cross_group_dtype}: with strategy.partition_group_size={group}, the "
                "world size, there is one group and nothing crosses between groups; leave it at float32, or use a "
                "smaller group"
            )
    if isinstance(s, MicsStrategyConfig) and s.cross_group_dtype != "float32" and run.trainer.precision == "bf16-true":
        raise UserError(
            f"strategy.cross_group_dtype={s.cross_group_dtype}: under trainer.precision=bf16-true the gradients are "
            "bf16 already, so it would change nothing; leave it at float32"
        )
    blocks = getattr(s, "block_classes", None)
    if blocks:
        model = _meta_model(run)
        if model is not None:
            from dtf.models.blocks import find_blocks

            find_blocks(model, list(blocks))


def _check_memory(run: RunConfig) -> None:
    """trainer.memory_check here, before any rank starts, where the ranks run on this machine
    (dtf.memory.checked_on_driver): the model is built on the meta device, once."""
    from dtf import memory
    from dtf.models import build_model

    t = run.trainer
    world = expected_world_size(run.launcher)
    # (a function builds its own models; an elastic run's world is known once its nodes have met)
    if t.memory_check == MemoryCheck.off or t.fn is not None or world is None:
        return
    if not memory.checked_on_driver(run.launcher):
        return
    local_ranks = (
        int(os.environ.get("LOCAL_WORLD_SIZE", world)) if dist_env.launched_externally() else run.launcher.nproc
    )
    on_gpu = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())

    def built() -> torch.nn.Module:  # as dtf.train.precision.Precision.convert_model has it
        model = build_model(run.composed.model)
        return model.to(torch.bfloat16) if t.precision == "bf16-true" else model

    def shares() -> memory.StateShares:
        from dtf import strategy  # only for a model too large for a whole replica on every rank
        from dtf.strategy import auto

        chosen = auto.most_sharded(run.strategy, world) if auto.wants_choice(run.strategy) else run.strategy
        return strategy.build(chosen, t.precision).state_shares(world)

    device = torch.device("cuda" if on_gpu else "cpu")
    advice = memory.NOTHING_FITS if isinstance(run.strategy, AutoStrategyConfig) else memory.SHARD_IT
    memory.check_before_start(
        built, shares, instantiate(run.composed.optimizer), memory.Node(local_ranks, device), t.memory_check, advice
    )


def _check_metrics(run: RunConfig, classes: bool) -> None:
    """Each metric a config with a _target_ (with classes: a torchmetrics Metric that fits the
    loss, see check_metric_classes), and an objective that names one."""
    t = run.trainer
    metrics = run.composed.get("metrics")
    if metrics is None:
        metrics = OmegaConf.create({})
    if not isinstance(metrics, DictConfig):
        raise UserError("metrics must map names to metric configs (metrics=rmse, metrics=[accuracy,f1], metrics=none)")
    for name, node in metrics.items():
        key = "metrics." + str(name)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise UserError(
                f"{key} has no _target_: give a torchmetrics class, e.g. {key}._target_=torchmetrics.MeanMetric"
            )
        if "num_classes" in node and node.num_classes is None:
            raise UserError(
                f"{key}.num_classes is not set (the model has no num_classes): set {key}.num_classes=<classes>"
            )
    if classes:
        from dtf.train.metrics import check_metric_classes

        check_metric_classes(metrics, run.composed.get("loss"))
    if t.fn is not None:
        return  # trainer=function: the objective names a value the function returns (checked when it has)
    split, _, value = t.objective.partition("/")
    if t.objective == "auto":
        return  # a loss: every run computes it
    if value != "loss" and value not in metrics:
        names = ", ".join(f"{split}/{n}" for n in ["loss", *map(str, metrics)])
        raise UserError(f"trainer.objective={t.objective} names no value this run computes: choose one of {names}")
    if split == "train" and value != "loss" and not t.train_metrics:
        raise UserError(
            f"trainer.objective={t.objective} needs the metrics on the training batches: set trainer.train_metrics=true"
        )


def _meta_model(run: RunConfig) -> torch.nn.Module | None:
    """The model built on the meta device (no memory, no init) to check names against it now;
    None when it cannot be built here (the ranks will report why, with its traceback). A model
    that refuses its settings (a UserError) refuses them here."""
    model = run.composed.model
    for full in sorted(OmegaConf.missing_keys(model)):  # ??? in the option (model=hf's name_or_path)
        raise UserError(f"{full} is not set: {MISSING_HINTS.get(full, f'give it a value, e.g. {full}=...')}")
    with torch.device("meta"):
        try:
            return instantiate(model) if "_target_" in model else None
        except Exception as e:
            refusal = user_error_in(e)  # instantiate wraps what the constructor raised
            if refusal is not None:
                raise refusal from None
            return None


def _check_performance_switches(run: RunConfig) -> None:
    """trainer.precision, compile and activation_checkpointing against this machine and this model."""
    t = run.trainer
    on_gpu = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    if on_gpu and "bf16" in t.precision and not torch.cuda.is_bf16_supported():
        raise UserError(
            f"trainer.precision={t.precision}: this GPU has no bf16 arithmetic; use trainer.precision=fp16-mixed or 32"
        )
    if t.compile:
        _check_inductor_can_build(t.compile, on_gpu)
    if not (t.activation_checkpointing or t.compile == "blocks"):
        return
    model = _meta_model(run)
    if model is None:
        return
    from dtf.train.blocks import checkpointed_blocks, compile_targets

    checkpointed_blocks(model, t.activation_checkpointing, getattr(run.strategy, "block_classes", None))
    if t.compile == "blocks" and not compile_targets(model, "blocks", getattr(run.strategy, "block_classes", None)):
        raise UserError(
            "trainer.compile=blocks: the model has no blocks (no nn.Sequential / nn.ModuleList children, no children "
            "with parameters); use trainer.compile=true"
        )


def _check_inductor_can_build(mode: bool | str, on_gpu: bool) -> None:
    """Inductor builds its CPU kernels with a C++ compiler ($CXX, else g++; clang++ on macOS), and
    GPU kernels with Triton: look for them as inductor does, without compiling anything here."""
    setting = f"trainer.compile={str(mode).lower()}"
    if on_gpu:
        if importlib.util.find_spec("triton") is None:
            raise UserError(f"{setting} needs Triton to build GPU kernels: install triton, or trainer.compile=false")
        return
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    try:
        subprocess.run([cxx, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        raise UserError(
            f"{setting} needs a C++ compiler to build CPU kernels and {cxx} does not run: install g++ "
            "(or set CXX to one), or use trainer.compile=false"
        ) from None
