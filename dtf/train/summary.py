"""The record of a finished run: `<run_dir>/summary.json`, the final line, TensorBoard's hparams,
and the exported weights. summary.json is written from one typed record (Summary: LoopSummary for
dtf's loop, FunctionSummary for trainer=function); every key is always there (null when it does
not apply), so that sweeps, tests and users never have to guess. Keys are added, never renamed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import statistics
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from dtf.config.typed import RunConfig
from dtf.dist.env import DistEnv
from dtf.files import write_json
from dtf.train.validator import describe, show

if TYPE_CHECKING:
    from dtf.train.trainer import Trainer

SUMMARY_FILE = "summary.json"
WEIGHTS_FILE = "model.pt"
BEST_WEIGHTS_FILE = "best_model.pt"  # checkpoint.keep_best: the weights of the best evaluation


def params_sha256(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """Digest of the full model state (names, dtypes, shapes, values), independent of sharding.
    state: a state dict, or its (name, tensor) pairs in sorted order (Strategy.whole_tensors)."""
    h = hashlib.sha256()
    pairs = sorted(state.items(), key=lambda item: item[0]) if isinstance(state, Mapping) else state
    for name, tensor in pairs:
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def config_sha256(cfg: DictConfig) -> str:
    """Digest of the config this rank trains with, as resolved: every rank of a run (and so every
    point of a sweep, on each of its ranks) must show the one the driver resolved."""
    return hashlib.sha256(OmegaConf.to_yaml(cfg, resolve=True).encode()).hexdigest()


def median_step_time(step_times: list[float], warmup_steps: int) -> float | None:
    """The median step time without the first steps (allocations, caches), if any are left."""
    times = step_times[min(warmup_steps, len(step_times) // 2) :]
    return statistics.median(times) if times else None


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (all of it: libraries, data, model, activations)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # kilobytes on Linux


class Record:
    """A record summary.json is written from."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def write(self, run_dir: Path) -> None:
        write_json(run_dir / SUMMARY_FILE, self.as_dict())


@dataclass(kw_only=True)
class Summary(Record):
    """What every run records, whichever trainer ran it."""

    world_size: int
    global_step: int  # rank 0's optimizer steps
    steps_per_rank: list[int]
    objective: float | None  # the value of objective_name, which sweeps compare runs by
    objective_name: str
    objective_mode: str  # min or max
    params_sha256: str | None  # of the final weights (a function's: of each model it built, comma-separated)
    # Replicas that disagree would be a bug in a strategy; the summary says so rather than hide it.
    params_sha256_consistent: bool
    peak_rss_bytes: list[int | None]  # per rank
    train_seconds: float
    strategy: str
    strategy_settings: Any  # as configured (strategy=auto: auto; what it chose is strategy and strategy_choice)
    launcher: str
    data_samples: int
    data_dropped_per_epoch: int  # over all ranks
    weights_file: str | None  # model.pt in the run dir, if exported
    run_dir: str


@dataclass(kw_only=True)
class LoopSummary(Summary):
    """dtf's own loop (trainer=default): its figures, curves and the facts of the run."""

    epochs: int
    final_train_loss: float
    final_test_loss: float | None
    train_loss_per_epoch: list[float]
    test_loss_per_epoch: list[float]
    final_metrics: dict[str, float]  # "train/loss", "test/loss", "test/<metric>", ...
    metrics_per_epoch: list[dict[str, float]]
    samples_per_sec: float | None
    step_time_s: float | None  # the median, without the first num_warmup_timing_steps
    # Rank 0's view: how long each save held up the loop (all of it, or only the copy when async).
    checkpoint_blocked_s: float | None
    checkpoints_saved: int
    model_state_bytes: list[int | None]  # per rank, as held after the first step
    # What trainer.memory_check estimated a rank would hold at its peak, by the ZeRO formula.
    model_state_estimate_bytes: int | None
    # trainer.compile's cost: the first step of this process compiles (rank 0's time), and what it compiled.
    first_step_s: float | None
    compiled_graphs: int | None
    # fp16-mixed: steps the gradient scaler skipped for overflowed gradients (null without a scaler).
    skipped_steps: int | None
    # trainer.on_nonfinite=skip: steps left out because their loss or gradients were not finite.
    nonfinite_steps_skipped: int
    # Each rank's digest of its resolved config: one config per run, whoever started the ranks.
    config_sha256_by_rank: list[str]
    config_consistent: bool
    samples_seen: int
    lr_final: float
    resumed_from_step: int | None
    # Seconds from choosing the checkpoint to its state loaded on every rank (checksums checked
    # where the ranks check them); None: the run did not resume.
    resume_s: float | None
    # Elastic runs: each change of the world size, {"step" (resumed from), "old_world_size",
    # "new_world_size", "time_lost_s" (from the old world's end to the new one's first step),
    # "steps_recomputed" (done by the old world after that checkpoint)}.
    membership_changes: list[dict[str, Any]]
    # strategy=auto or partition_group_size=auto: the links measured, the plan chosen and each plan's
    # predicted communication per step (dtf.strategy.auto); null for a strategy named in full.
    strategy_choice: dict[str, Any] | None
    data_batches_per_epoch: int
    data_repeated_per_epoch: int  # over all ranks
    # Parquet's data.canonical_partitions as used (auto resolved); null for in-memory data.
    data_canonical_partitions: int | None
    slurm_job_id: str | None  # proof of where it ran, for sacct / scontrol
    slurm_restarts: int | None
    pruned: bool  # hydra/sweeper=dtf pruned the trial after `epochs` epochs
    # The validation split's latest loss (null without one); every evaluation during training, as
    # {"step", "epoch" (fractional), "val/loss", "val/<metric>", ...} (test/* without a validation split).
    final_val_loss: float | None
    evaluations: list[dict[str, float]]
    # The best objective at an evaluation (or epoch end, for train/*) and its step.
    best_step: int | None
    best_objective: float | None
    stopped_early: str | None  # why trainer.early_stopping ended training (null: it did not)
    best_weights_file: str | None  # best_model.pt in the run dir (checkpoint.keep_best)


@dataclass(kw_only=True)
class FunctionSummary(Summary):
    """trainer=function: what the user's function returned, averaged over the ranks."""

    mode: str = "function"
    result: float | dict[str, float]
    optimizer_state_bytes: list[int | None]  # per rank: the function's optimizers' state
    # per rank, after the first step: parameters, gradients and optimizer state (the Trainer's model_state_bytes)
    model_state_bytes: list[int | None]


@dataclass(kw_only=True)
class TorchrunSummary(Record):
    """dtf.run_function(mode="torchrun"): the function ran its own process group, so this is
    what rank 0 saw."""

    mode: str = "torchrun"
    world_size: int
    result: Any  # rank 0's return value (its repr where JSON cannot hold it)
    objective: float | None  # the result, or its trainer.objective key, when a number
    objective_name: str
    objective_mode: str
    global_step: int  # rank 0's optimizer steps
    train_seconds: float
    launcher: str
    run_dir: str


def as_json(value: Any) -> Any:
    """value where JSON holds it as it is, else its repr."""
    import json

    try:
        return value if json.loads(json.dumps(value)) == value else repr(value)
    except (TypeError, ValueError):
        return repr(value)


@dataclass(frozen=True)
class RankFigures:
    """What one rank knows of itself at the end, gathered to rank 0."""

    steps: int
    params_digest: str
    peak_rss: int | None
    config_digest: str | None = None  # dtf's loop
    model_state_bytes: int | None = None
    optimizer_state_bytes: int | None = None  # trainer=function


def from_every_rank(local: RankFigures, env: DistEnv) -> list[RankFigures]:
    """Every rank's figures, in rank order (a collective where there are several ranks)."""
    if not (dist.is_initialized() and env.world_size > 1):
        return [local]
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, local)
    return gathered


def shared_fields(run: RunConfig, ranks: list[RankFigures], run_dir: Path) -> dict[str, Any]:
    """The Summary fields both trainers fill the same way."""
    return dict(
        world_size=len(ranks),
        steps_per_rank=[r.steps for r in ranks],
        params_sha256=ranks[0].params_digest or None,
        params_sha256_consistent=len({r.params_digest for r in ranks}) == 1,
        peak_rss_bytes=[r.peak_rss for r in ranks],
        objective_mode=run.trainer.objective_mode.value,
        strategy=run.strategy.name,
        strategy_settings=OmegaConf.to_container(run.composed.strategy),
        launcher=run.launcher.name,
        run_dir=str(run_dir),
    )


def finish(run: RunConfig, trainer: Trainer, run_dir: Path) -> LoopSummary | None:
    """Collective, after fit(): digests the model on every rank; rank 0 exports the weights, logs
    the hparams, writes summary.json, prints the final line and returns the summary."""
    env = trainer.env
    state: dict[str, torch.Tensor] = {}  # the weights rank 0 exports
    keep = run.trainer.export_weights and env.is_main

    def kept(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in pairs:
            if keep:
                state[name] = tensor.detach()
            yield name, tensor

    # Digested on every rank one whole tensor at a time (for sharded strategies an all-gather per
    # tensor: a model that fits only sharded is never whole on a rank).
    digest = params_sha256(kept(trainer.strategy.whole_tensors(trainer.model)))
    local = RankFigures(
        trainer.state.step, digest, peak_rss_bytes(), config_sha256(run.composed), trainer.model_state_bytes
    )
    ranks = from_every_rank(local, env)
    if not env.is_main:
        return None
    summary = loop_summary(run, trainer, ranks, run_dir)
    if run.trainer.export_weights:  # in the module's order, as torch.save(model.state_dict()) has it
        torch.save({name: state[name] for name in trainer.strategy.state_names(trainer.model)}, run_dir / WEIGHTS_FILE)
    results: dict[str, float | None] = {"objective": summary.objective, **summary.final_metrics}
    trainer.loggers.hparams(tensorboard_hparams(run, trainer), results)
    summary.write(run_dir)
    trainer.loggers.finish(run_dir)  # the run's files as artifacts, where a logger keeps them
    print(
        f"dtf: final {describe(summary.final_metrics)} (over {env.world_size} rank(s)); "
        f"{summary.objective_name} {show(summary.objective)} ({summary.objective_mode}); "
        f"step {summary.step_time_s or float('nan'):.3g}s median; summary {run_dir / SUMMARY_FILE}",
        flush=True,
    )
    return summary


def loop_summary(run: RunConfig, trainer: Trainer, ranks: list[RankFigures], run_dir: Path) -> LoopSummary:
    st, data, blocked = trainer.state, trainer.train_data, trainer.checkpointer.blocked_s
    finals = st.latest_metrics()
    objective = trainer.validator.selection.objective
    val_losses = [e["val/loss"] for e in st.evaluations if "val/loss" in e]
    on_slurm = "SLURM_JOB_ID" in os.environ
    return LoopSummary(
        **shared_fields(run, ranks, run_dir),
        global_step=st.step,
        epochs=st.epoch,
        final_train_loss=st.last_train_loss,
        final_test_loss=st.last_test_loss,
        train_loss_per_epoch=st.train_loss_curve,
        test_loss_per_epoch=st.test_loss_curve,
        final_metrics=finals,
        metrics_per_epoch=st.metrics_per_epoch,
        samples_per_sec=st.samples_seen / st.train_seconds if st.train_seconds > 0 else None,
        step_time_s=median_step_time(trainer.step_times, trainer.s.num_warmup_timing_steps),
        checkpoint_blocked_s=statistics.median(blocked) if blocked else None,
        checkpoints_saved=len(blocked),
        model_state_bytes=[r.model_state_bytes for r in ranks],
        model_state_estimate_bytes=trainer.model_state_estimate_bytes,
        first_step_s=trainer.first_step_s,
        compiled_graphs=trainer.compiled_graphs,
        skipped_steps=trainer.precision.skipped_steps if trainer.precision.scaler is not None else None,
        nonfinite_steps_skipped=trainer.nonfinite.skipped,
        config_sha256_by_rank=[str(r.config_digest) for r in ranks],
        config_consistent=len({r.config_digest for r in ranks}) == 1,
        samples_seen=st.samples_seen,
        train_seconds=st.train_seconds,
        lr_final=trainer.optimizer.param_groups[0]["lr"],
        resumed_from_step=trainer.resumed_from_step,
        resume_s=trainer.resume_s,
        membership_changes=st.membership_changes,
        strategy_choice=trainer.strategy_choice,
        data_samples=data.num_samples,
        data_batches_per_epoch=len(data),
        data_dropped_per_epoch=data.num_dropped_per_epoch,
        data_repeated_per_epoch=data.num_repeated_per_epoch,
        data_canonical_partitions=data.num_partitions,
        slurm_job_id=os.environ["SLURM_JOB_ID"] if on_slurm else None,
        slurm_restarts=int(os.environ.get("SLURM_RESTART_COUNT", 0)) if on_slurm else None,
        weights_file=WEIGHTS_FILE if run.trainer.export_weights else None,
        objective=finals.get(objective),
        objective_name=objective,
        pruned=trainer.validator.pruned_at_epoch is not None,
        final_val_loss=val_losses[-1] if val_losses else None,
        evaluations=st.evaluations,
        best_step=st.best_step,
        best_objective=st.best_objective,
        stopped_early=st.stopped_early,
        best_weights_file=BEST_WEIGHTS_FILE if trainer.validator.best_model_path is not None else None,
    )


def tensorboard_hparams(run: RunConfig, trainer: Trainer) -> dict[str, Any]:
    return {
        "world_size": trainer.env.world_size,
        "strategy": run.strategy.name,
        "lr": run.composed.optimizer.get("lr"),
        "batch_size": run.data.batch_size,
        "grad_accum_steps": run.trainer.grad_accum_steps,
        "lr_scaling": run.trainer.lr_scaling,
    }
