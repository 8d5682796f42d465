"""The record of a finished run: `<run_dir>/summary.json`, the final line, TensorBoard's hparams,
and the exported weights. Every key of the summary is always there (null when it does not apply),
so that sweeps, tests and users never have to guess.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from dtf.config.typed import RunConfig
from dtf.train.trainer import describe, show

if TYPE_CHECKING:
    from dtf.train.trainer import Trainer

SUMMARY_FILE = "summary.json"
WEIGHTS_FILE = "model.pt"


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


def gather(trainer: Trainer, digest: str, run_dir: Path, config_digest: str) -> dict[str, Any] | None:
    """The loop's figures, with each rank's steps, state size and digests of weights and config (a
    collective); the summary on rank 0, None elsewhere."""
    env, st, blocked = trainer.env, trainer.state, trainer.checkpointer.blocked_s
    local = {
        "steps": st.step,
        "bytes": trainer.model_state_bytes,
        "digest": digest,
        "peak_rss": peak_rss_bytes(),
        "config": config_digest,
    }
    gathered: list[Any] = [local]
    if dist.is_initialized() and env.world_size > 1:
        gathered = [None] * env.world_size
        dist.all_gather_object(gathered, local)
    if not env.is_main:
        return None
    return {
        "world_size": env.world_size,
        "global_step": st.step,
        "epochs": st.epoch,
        "steps_per_rank": [g["steps"] for g in gathered],
        "final_train_loss": st.last_train_loss,
        "final_test_loss": st.last_test_loss,
        "train_loss_per_epoch": st.train_loss_curve,
        "test_loss_per_epoch": st.test_loss_curve,
        "final_metrics": st.latest_metrics(),  # "train/loss", "test/loss", "test/<metric>", ...
        "metrics_per_epoch": st.metrics_per_epoch,
        "samples_per_sec": st.samples_seen / st.train_seconds if st.train_seconds > 0 else None,
        "step_time_s": median_step_time(trainer.step_times, trainer.s.num_warmup_timing_steps),
        # Rank 0's view: how long each save held up the loop (all of it, or only the copy when async).
        "checkpoint_blocked_s": statistics.median(blocked) if blocked else None,
        "checkpoints_saved": len(blocked),
        "model_state_bytes": [g["bytes"] for g in gathered],
        # What trainer.memory_check estimated a rank would hold at its peak, by the ZeRO formula.
        "model_state_estimate_bytes": trainer.model_state_estimate_bytes,
        "peak_rss_bytes": [g["peak_rss"] for g in gathered],
        # trainer.compile's cost: the first step of this process compiles (rank 0's time), and what it compiled.
        "first_step_s": trainer.first_step_s,
        "compiled_graphs": trainer.compiled_graphs,
        # fp16-mixed: steps the gradient scaler skipped for overflowed gradients (null without a scaler).
        "skipped_steps": trainer.precision.skipped_steps if trainer.precision.scaler is not None else None,
        "params_sha256": digest,
        # Replicas that disagree would be a bug in a strategy; the summary says so rather than hide it.
        "params_sha256_consistent": len({g["digest"] for g in gathered}) == 1,
        # Each rank's digest of its resolved config: one config per run, whoever started the ranks.
        "config_sha256_by_rank": [g["config"] for g in gathered],
        "config_consistent": len({g["config"] for g in gathered}) == 1,
        "samples_seen": st.samples_seen,
        "train_seconds": st.train_seconds,
        "lr_final": trainer.optimizer.param_groups[0]["lr"],
        "resumed_from_step": trainer.resumed_from_step,
        "run_dir": str(run_dir),
    }


def run_facts(run: RunConfig, cfg: DictConfig, trainer: Trainer) -> dict[str, Any]:
    """What the run was: strategy, launcher, data, and where it ran."""
    data = trainer.train_data
    on_slurm = "SLURM_JOB_ID" in os.environ  # proof of where it ran, for sacct / scontrol
    return {
        "strategy": run.strategy.name,
        "strategy_settings": OmegaConf.to_container(cfg.strategy),
        "launcher": run.launcher.name,
        "data_samples": data.num_samples,
        "data_batches_per_epoch": len(data),
        "data_dropped_per_epoch": data.num_dropped_per_epoch,  # over all ranks
        "data_repeated_per_epoch": data.num_repeated_per_epoch,
        # Parquet's data.canonical_partitions as used (auto resolved); null for in-memory data.
        "data_canonical_partitions": getattr(data, "num_partitions", None),
        "slurm_job_id": os.environ["SLURM_JOB_ID"] if on_slurm else None,
        "slurm_restarts": int(os.environ.get("SLURM_RESTART_COUNT", 0)) if on_slurm else None,
        "weights_file": WEIGHTS_FILE if run.trainer.export_weights else None,
    }


def objective_of(run: RunConfig, has_test_set: bool) -> str:
    """trainer.objective, where the run can compute it: the default test/loss of a run without a
    test set is its train/loss (a test/<metric> there is refused where the data is built)."""
    objective = run.trainer.objective
    return "train/loss" if objective == "test/loss" and not has_test_set else objective


def finish(run: RunConfig, cfg: DictConfig, trainer: Trainer, run_dir: Path) -> dict[str, Any] | None:
    """Collective, after fit(): digests the model on every rank; rank 0 exports the weights, logs
    the hparams, writes summary.json, prints the final line and returns the summary."""
    # Digested on every rank one whole tensor at a time (for sharded strategies an all-gather per
    # tensor: a model that fits only sharded is never whole on a rank), kept by rank 0 to export.
    state: dict[str, torch.Tensor] = {}
    keep = run.trainer.export_weights and trainer.env.is_main

    def kept(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in pairs:
            if keep:
                state[name] = tensor.detach()
            yield name, tensor

    digest = params_sha256(kept(trainer.strategy.whole_tensors(trainer.model)))
    summary = gather(trainer, digest, run_dir, config_sha256(cfg))
    if summary is None:
        return None
    summary.update(run_facts(run, cfg, trainer))
    objective = objective_of(run, trainer.eval_data is not None)
    summary.update(
        objective=summary["final_metrics"].get(objective),
        objective_name=objective,
        objective_mode=run.trainer.objective_mode.value,
    )
    # hydra/sweeper=dtf: a trial the search pruned ends here, after `epochs` epochs.
    summary.update(pruned=trainer.pruned_at_epoch is not None)
    if run.trainer.export_weights:
        torch.save(state, run_dir / WEIGHTS_FILE)
    hparams = {
        "world_size": trainer.env.world_size,
        "strategy": run.strategy.name,
        "lr": cfg.optimizer.get("lr"),
        "batch_size": run.data.batch_size,
        "grad_accum_steps": run.trainer.grad_accum_steps,
        "lr_scaling": run.trainer.lr_scaling,
    }
    finals = summary["final_metrics"]
    trainer.tb.hparams(hparams, {"objective": summary["objective"], **finals})
    write(run_dir, summary)
    print(
        f"dtf: final {describe(finals)} (over {trainer.env.world_size} rank(s)); "
        f"{objective} {show(summary['objective'])} ({summary['objective_mode']}); "
        f"step {summary['step_time_s'] or float('nan'):.3g}s median; summary {run_dir / SUMMARY_FILE}",
        flush=True,
    )
    return summary


def write(run_dir: Path, summary: dict[str, Any]) -> None:
    """Atomically: readers (sweeps, tests) never see half a file."""
    tmp = run_dir / (SUMMARY_FILE + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    os.replace(tmp, run_dir / SUMMARY_FILE)
