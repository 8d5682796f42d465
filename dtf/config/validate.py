"""Rules Hydra's schemas cannot express, checked on the driver before any process starts.

Every failure is a UserError whose message names the key and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from hydra._internal.utils import _locate
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from dtf.config.schema import PRECISIONS
from dtf.dist import env as dist_env
from dtf.errors import UserError

# Keys Hydra's instantiate consumes itself; everything else is passed to the target.
_HYDRA_KEYS = {"_target_", "_partial_", "_args_", "_recursive_", "_convert_"}
_BACKENDS = ("auto", "gloo", "nccl", "mpi")


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise UserError(f"{key}={value} is invalid: {rule}")


def validate(cfg: DictConfig) -> None:
    for section in ("trainer", "data", "strategy", "launcher", "checkpoint"):
        _check_known_keys(cfg[section], section)
    _check_trainer(cfg.trainer)
    _check_data(cfg.data)
    if "path" in cfg.data.keys():  # noqa: SIM118 - data=petastorm; `in` alone misses a path that is still ???
        _check_petastorm_data(cfg)
    _check_launcher(cfg.launcher, cfg.checkpoint)
    _check_gpus(cfg)
    _check_checkpoint(cfg.checkpoint)
    _check_strategy(cfg)
    lr = cfg.optimizer.get("lr") if isinstance(cfg.optimizer, DictConfig) else None
    if lr is not None:
        _require(
            isinstance(lr, int | float) and lr > 0,
            "optimizer.lr",
            lr,
            "give a positive learning rate, e.g. optimizer.lr=1e-3",
        )
    for section in ("model", "optimizer", "scheduler", "loss", "data", "trainer"):
        node = cfg.get(section)
        if node is not None:
            for path, target_node in _targets(node, section):
                _check_target(path, target_node)


def _check_known_keys(node: DictConfig, section: str) -> None:
    """Hydra lets `+section.key=...` add a key to a schema'd node; dtf would silently ignore it."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    fields = {f.name for f in dataclasses.fields(schema)}
    for key in map(str, node):
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f"did you mean {section}.{close[0]}?" if close else f"its keys: {', '.join(sorted(fields))}"
            raise UserError(f"{section}.{key} is not a setting of dtf's {section} ({hint}); remove +{section}.{key}")


def _check_trainer(t: DictConfig) -> None:
    _require(t.max_epochs >= 1, "trainer.max_epochs", t.max_epochs, "train at least one epoch")
    _require(
        t.max_steps is None or t.max_steps >= 1,
        "trainer.max_steps",
        t.max_steps,
        "use a positive number, or null to train max_epochs",
    )
    _require(t.grad_accum_steps >= 1, "trainer.grad_accum_steps", t.grad_accum_steps, "use 1 (no accumulation) or more")
    _require(
        t.grad_clip_norm is None or t.grad_clip_norm > 0,
        "trainer.grad_clip_norm",
        t.grad_clip_norm,
        "use a positive norm, or null for no clipping",
    )
    _require(t.warmup_steps >= 0, "trainer.warmup_steps", t.warmup_steps, "use 0 (no warm-up) or more")
    _require(
        t.warmup_start_factor is None or 0 < t.warmup_start_factor <= 1,
        "trainer.warmup_start_factor",
        t.warmup_start_factor,
        "use a factor in (0, 1], or null for the default",
    )
    _require(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", t.log_every_n_steps, "use 1 or more")
    _require(t.eval_every_n_epochs >= 1, "trainer.eval_every_n_epochs", t.eval_every_n_epochs, "use 1 or more")
    _require(t.dist_timeout_s > 0, "trainer.dist_timeout_s", t.dist_timeout_s, "use a positive number of seconds")
    _require(
        t.num_warmup_timing_steps >= 0, "trainer.num_warmup_timing_steps", t.num_warmup_timing_steps, "use 0 or more"
    )
    _require(
        t.dist_backend in _BACKENDS, "trainer.dist_backend", t.dist_backend, f"choose one of {', '.join(_BACKENDS)}"
    )
    device = str(t.device)
    _require(device in ("auto", "cpu", "cuda"), "trainer.device", device, "choose auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is visible: use trainer.device=auto or cpu")
    if t.dist_backend == "nccl" and (device == "cpu" or not torch.cuda.is_available()):
        raise UserError("trainer.dist_backend=nccl needs CUDA devices: use trainer.dist_backend=auto or gloo")


def _check_data(d: DictConfig) -> None:
    if "batch_size" in d:
        _require(d.batch_size >= 1, "data.batch_size", d.batch_size, "use a per-rank batch size of 1 or more")
    if d.get("eval_batch_size") is not None:
        _require(
            d.eval_batch_size >= 1,
            "data.eval_batch_size",
            d.eval_batch_size,
            "use 1 or more, or null for data.batch_size",
        )
    if "num_workers" in d:
        _require(d.num_workers >= 0, "data.num_workers", d.num_workers, "use 0 (load in the rank) or more")


def _check_petastorm_data(cfg: DictConfig) -> None:
    """data=petastorm, from the Parquet metadata only: files readable, columns present, and a full
    batch for every rank. The ranks check the same again (they may see other files)."""
    d = cfg.data
    _require(d.workers_count >= 1, "data.workers_count", d.workers_count, "use 1 or more reader workers")
    _require(d.results_queue_size >= 1, "data.results_queue_size", d.results_queue_size, "use 1 or more")
    from dtf.data.parquet_source import open_sources  # pyarrow and petastorm: only for runs that read Parquet

    open_sources(d, expected_world_size(cfg))


def _check_checkpoint(c: DictConfig) -> None:
    _require(
        c.every_n_steps is None or c.every_n_steps >= 1,
        "checkpoint.every_n_steps",
        c.every_n_steps,
        "use a positive number of optimizer steps, or null to save only at the end",
    )
    _require(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, "keep at least 1 checkpoint")
    _require(
        c.stop_check_every_n_steps >= 1,
        "checkpoint.stop_check_every_n_steps",
        c.stop_check_every_n_steps,
        "use 1 or more",
    )
    from dtf.train.stop import STOPPABLE_SIGNALS

    for name in c.stop_signals:
        _require(
            name in STOPPABLE_SIGNALS,
            "checkpoint.stop_signals",
            name,
            f"use signal names among {', '.join(STOPPABLE_SIGNALS)}, or [] to die on them as usual",
        )
    if c.resume not in ("auto", "never"):
        from dtf.train.checkpoint import resolve_resume  # torch.distributed.checkpoint: only when needed

        resolve_resume(c.resume, Path(c.resume))  # a named checkpoint must exist and be complete


def _check_launcher(launcher: DictConfig, checkpoint: DictConfig) -> None:
    for key in ("nodes", "tasks_per_node", "cpus_per_task"):
        if key in launcher:
            _require(launcher[key] >= 1, f"launcher.{key}", launcher[key], "use 1 or more")
    if "signal" in launcher:
        _require(
            launcher.signal in checkpoint.stop_signals,
            "launcher.signal",
            launcher.signal,
            f"it must be one of checkpoint.stop_signals ({', '.join(checkpoint.stop_signals)}), or the ranks "
            "would die of it instead of saving",
        )
    if "nproc" in launcher:
        _require(
            launcher.nproc >= 1, "launcher.nproc", launcher.nproc, "start at least one rank, e.g. launcher.nproc=2"
        )
    if "max_restarts" in launcher:
        _require(
            launcher.max_restarts >= 0, "launcher.max_restarts", launcher.max_restarts, "use 0 (no restart) or more"
        )


def _check_gpus(cfg: DictConfig) -> None:
    """One GPU per rank (each rank pins the GPU of its local rank): more ranks per machine than GPUs
    would put two ranks on one GPU, which NCCL refuses in the middle of the start-up."""
    launcher, device = cfg.launcher, str(cfg.trainer.device)
    if device == "cpu":
        return
    gpus_per_node = launcher.get("gpus_per_node")
    if gpus_per_node and launcher.tasks_per_node > gpus_per_node:  # SLURM: the nodes' GPUs, as asked for
        raise UserError(
            f"launcher.tasks_per_node={launcher.tasks_per_node} is more than launcher.gpus_per_node={gpus_per_node} "
            "GPUs: every rank needs a GPU of its own; lower launcher.tasks_per_node or raise launcher.gpus_per_node"
        )
    if launcher.name == "local" and not dist_env.launched_externally() and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if launcher.nproc > visible:
            raise UserError(
                f"launcher.nproc={launcher.nproc} is more than the {visible} GPU(s) visible here: every rank needs "
                f"a GPU of its own; use launcher.nproc={visible} or fewer, or trainer.device=cpu"
            )


def expected_world_size(cfg: DictConfig) -> int | None:
    """The number of ranks the launcher will start, when the driver can know it."""
    if dist_env.launched_externally():
        return int(os.environ["WORLD_SIZE"])
    per_node = cfg.launcher.get("nproc", cfg.launcher.get("tasks_per_node"))
    return None if per_node is None else int(per_node) * int(cfg.launcher.get("nodes", 1))


def _check_strategy(cfg: DictConfig) -> None:
    s = cfg.strategy
    if s.name == "zero":
        if s.stage == 1 and s.meta_init:
            raise UserError("strategy.meta_init=true needs strategy.stage=2 or 3 (stage 1 keeps whole parameters)")
        _require(
            s.stage in (1, 2, 3),
            "strategy.stage",
            s.stage,
            "choose 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters)",
        )
    for key in ("param_dtype", "reduce_dtype"):
        value = s.get(key)
        _require(
            value is None or value in PRECISIONS,
            f"strategy.{key}",
            value,
            f"choose one of {', '.join(PRECISIONS)} or null",
        )
    if s.name == "mics":
        group = s.partition_group_size
        world = expected_world_size(cfg)
        _require(group >= 1, "strategy.partition_group_size", group, "use 1 (DDP) up to the world size (ZeRO-3)")
        if world is not None and world % group != 0:
            valid = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
            raise UserError(
                f"strategy.partition_group_size={group} does not divide the world size {world}: use one of {valid}"
            )
    if s.get("block_classes"):
        # Build the model on the meta device (no memory, no init) to check the names now.
        with torch.device("meta"):
            try:
                model = instantiate(cfg.model) if "_target_" in cfg.model else None
            except Exception:
                return  # the ranks will report it with its traceback
        if model is not None:
            from dtf.strategy.fsdp import find_blocks

            find_blocks(model, list(s.block_classes))


def _targets(node: Any, path: str) -> Iterator[tuple[str, DictConfig]]:
    """Every config node with a _target_ below node, with its dotted path."""
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
        for key in node:
            if key not in _HYDRA_KEYS:
                yield from _targets(node._get_node(key), f"{path}.{key!s}")
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from _targets(item, f"{path}[{i}]")


def _check_target(path: str, node: DictConfig) -> None:
    target = str(node._target_)
    try:
        obj = _locate(str(target))
    except Exception as e:  # _locate raises ImportError with the real cause chained
        cause = e.__cause__ or e
        raise UserError(
            f"{path}._target_={target} cannot be imported ({type(cause).__name__}: {cause}): "
            "check the dotted path, or make its module importable (install it or add it to PYTHONPATH)"
        ) from None
    if not callable(obj):
        raise UserError(f"{path}._target_={target} is not callable: point it at a class or function")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # builtins without a signature: let instantiate decide
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    for key in map(str, node):
        if key not in _HYDRA_KEYS and key not in sig.parameters:
            accepted = ", ".join(n for n in sig.parameters if n != "self")
            raise UserError(
                f"{path}.{key} is not a parameter of {target} (it takes: {accepted}): "
                f"fix the name or remove it with ~{path}.{key}"
            )
