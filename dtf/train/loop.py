"""dtf's own loop on one rank, from the run's config: build its parts (model, data, optimizer and
schedule, the Trainer), fit, and finish with the run's record. Each phase has one job; the
process around them (environment, process group, signals) is dtf.rank's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn
from torch.optim import Optimizer

from dtf import elastic, failures, memory, remote
from dtf import strategy as strategies
from dtf.config.schema import MemoryCheck, ParquetDataConfig, TextDataConfig
from dtf.config.typed import DataConfig, RunConfig
from dtf.data import loader
from dtf.data.interface import DataSplits
from dtf.dist import env as dist_env
from dtf.errors import EveryRankUserError, UserError
from dtf.heartbeat import Heartbeat
from dtf.machine import lone_rank_threads_note
from dtf.models import build_model
from dtf.models.hf import write_hf_files
from dtf.results import Finished, RunResult, Stopped
from dtf.signals import StopRequest
from dtf.strategy import auto as auto_strategy
from dtf.train import blocks, debug, hf_export, loggers, schedule
from dtf.train import summary as run_summary
from dtf.train.checkpoint import Checkpointer, LocalCopies, choose_start, committed, damaged, recorded_position
from dtf.train.checkpoint_store import RemotePath, Where, checkpoint_root, location
from dtf.train.control import StepControl
from dtf.train.forward import Forward, supervised_step
from dtf.train.loss import TargetsLikeOutput
from dtf.train.metrics import Metrics
from dtf.train.optimizer import fused_where_possible
from dtf.train.precision import Precision
from dtf.train.rng import seed_everything
from dtf.train.selection import TEST_BIAS_WARNING, resolve_objective
from dtf.train.state import TrainState
from dtf.train.trainer import Trainer
from dtf.train.validator import Pruning, Validator


def run(
    run: RunConfig, env: dist_env.DistEnv, run_dir: Path, stop_request: StopRequest | None = None
) -> RunResult | None:
    """Rank 0 returns Finished (the others None), or every rank Stopped when the ranks agreed to stop.
    stop_request: the rank's stop-signal handlers (none: nothing stops the run early)."""
    stop_request = stop_request or StopRequest(())
    beat = Heartbeat(run_dir, env.rank, dist_env.attempt_number())
    beat.start()  # from here, the driver sees how far this rank got (dtf.launch.stalls)
    try:
        run, choice = chosen_strategy(run, env)
        trainer = build(run, env, run_dir, stop_request, beat)
        trainer.strategy_choice = choice
        done = already_finished(trainer, run_dir)
        if done is not None:
            return done if env.is_main else None
        start_loggers(run, trainer)
        try:
            with profiling(run, trainer, run_dir):
                trainer.fit()
            beat.mark("finishing")
            result = finish(run, trainer, run_dir, stop_request)
        except BaseException:
            # where this world got to, for the next one's record of the change (a peer lost: an elastic restart)
            elastic.record_end(run_dir, env.rank, env.world_size, trainer.state.step)
            trainer.loggers.close("failed")
            raise
        if isinstance(result, Stopped):  # a stop signal (the agent stops the ranks for a node that joins, too)
            elastic.record_end(run_dir, env.rank, env.world_size, trainer.state.step)
        return result
    finally:
        beat.close()


def profiling(run: RunConfig, trainer: Trainer, run_dir: Path) -> contextlib.AbstractContextManager[Any]:
    """trainer.profiler around the fit, told of every optimizer step; nothing where it is off."""
    profiler = debug.profiler(run.trainer.profiler, run_dir, trainer.env)
    if profiler is None:
        return contextlib.nullcontext()
    trainer.step_hooks.append(profiler.step)
    return profiler


def start_loggers(run: RunConfig, trainer: Trainer) -> None:
    """Rank 0's loggers start (a resumed run's tracking runs continue); every rank's checkpoints
    then keep the same tracking run ids. Collective where a tracking run is kept."""
    trainer.loggers.start(trainer.state)
    st = trainer.state
    if "mlflow" in run.loggers or "wandb" in run.loggers:
        st.mlflow_run_id, st.wandb_run_id = dist_env.broadcast_from_main((st.mlflow_run_id, st.wandb_run_id))


def already_finished(trainer: Trainer, run_dir: Path) -> Finished | None:
    """A finished run, run again: its summary (untouched, as model.pt and the rest), when the run
    resumed from its final checkpoint, whose weights summary.json describes. Collective."""
    if trainer.resumed_from_step is None:
        return None
    summary: dict[str, Any] | None = None
    if trainer.env.is_main:
        with contextlib.suppress(OSError, ValueError):
            summary = json.loads((run_dir / run_summary.SUMMARY_FILE).read_text())
    recorded = summary if isinstance(summary, dict) and summary.get("global_step") == trainer.state.step else None
    # Finished: its budget spent, or trainer.early_stopping ended it at this step (its summary says so).
    if trainer.state.step < trainer.total_steps and not (recorded and recorded.get("stopped_early")):
        recorded = None
    # The weights must be the ones it describes (not a summary of an earlier run that ended on the same step).
    same = dist_env.broadcast_from_main(recorded is not None)
    if not same:
        return None
    digest = run_summary.params_sha256(trainer.strategy.whole_tensors(trainer.model))  # collective
    if not dist_env.broadcast_from_main(recorded is not None and recorded.get("params_sha256") == digest):
        return None
    if not trainer.env.is_main:
        return Finished({})
    assert recorded is not None
    print(
        f"dtf: this run already finished at step {trainer.state.step} (its summary.json and model.pt are left as they "
        "are): raise trainer.max_steps or trainer.max_epochs to train on, or start over with checkpoint.resume=never "
        "or another hydra.run.dir",
        flush=True,
    )
    return Finished(recorded)


def build(
    run: RunConfig, env: dist_env.DistEnv, run_dir: Path, stop_request: StopRequest, beat: Heartbeat | None = None
) -> Trainer:
    """The Trainer, ready to fit: from its checkpoint when the run resumes."""
    if run.trainer.deterministic:
        # cuBLAS is deterministic only with a fixed workspace, which must be set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    # Same seed everywhere for the model's initial weights (DDP also broadcasts rank 0's) ...
    seed_everything(run.trainer.seed)
    parts = setup_model(run, env)
    if env.is_main:  # model=hf: its config and tokenizer beside the run's weights (dtf.export reads them)
        write_hf_files(parts.model, run_dir / "hf")
    started = time.perf_counter()
    resume, copies = choose_checkpoint(run, env, run_dir)
    chosen_s = time.perf_counter() - started
    try:
        # After the checkpoint is chosen: a resumed run's Parquet sequence is the one it recorded.
        recorded = recorded_position(resume, copies).canonical_partitions if resume is not None else None
        splits = setup_data(run, env, recorded)
        optimizer_factory = fused_where_possible(instantiate(run.composed.optimizer))
        model, optimizer = parts.strategy.setup(parts.model, optimizer_factory, env)
        # After the wrapping: DDP's and FSDP's hooks stay outside the compiled code.
        blocks.compile_model(parts.model, run.trainer.compile, getattr(run.strategy, "block_classes", None))
        # ... and a different stream per rank for what happens during training (dropout, augmentation).
        seed_everything(run.trainer.seed + env.rank)
        trainer = assemble(run, env, run_dir, stop_request, parts, model, optimizer, splits, beat)
        if resume is not None:
            started = time.perf_counter()
            trainer.resume_from(resume, copies)
            trainer.resume_s = chosen_s + time.perf_counter() - started
            if env.is_main:
                print(f"dtf: resumed from {resume} (step {trainer.state.step})", flush=True)
    finally:
        if copies is not None:
            copies.remove()
    trainer.membership_change = membership_change(trainer, run_dir)
    announce(run, trainer, run_dir, resumed=resume is not None)
    return trainer


def membership_change(trainer: Trainer, run_dir: Path) -> dict[str, Any] | None:
    """The change of world size since the checkpoint this run resumed from, with the cost the old
    world's ranks recorded as they ended (dtf.elastic); None: the same size. Collective."""
    env, change = trainer.env, None
    if env.is_main:
        ended = elastic.take_ended(run_dir)  # taken whatever happens: a later change must not see them
        old = trainer.resumed_from_world
        if trainer.resumed_from_step is not None and old is not None and old != env.world_size:
            change = elastic.change(ended, trainer.resumed_from_step, old, env.world_size)
    return dist_env.broadcast_from_main(change)


def chosen_strategy(run: RunConfig, env: dist_env.DistEnv) -> tuple[RunConfig, dict[str, Any] | None]:
    """The run with strategy=auto (or mics' partition_group_size=auto) made concrete, and the record
    of the choice; as it is, and None, for a named strategy. Collective."""
    if not auto_strategy.wants_choice(run.strategy):
        return run, None
    t = run.trainer
    precision = Precision(t.precision, env.device, None)
    concrete, record = auto_strategy.resolve(
        run.strategy,
        env,
        lambda: precision.convert_model(build_model(run.composed.model)),
        instantiate(run.composed.optimizer),
        t.memory_check,
        t.precision,
    )
    return dataclasses.replace(run, strategy=concrete), record


@dataclass
class ModelParts:
    """The model as built (before the strategy wraps it), and what builds and runs it."""

    strategy: strategies.Strategy
    precision: Precision
    model: nn.Module
    state_estimate_bytes: int | None  # trainer.memory_check's, by the strategy's ZeRO formula


def setup_model(run: RunConfig, env: dist_env.DistEnv) -> ModelParts:
    """The strategy, the precision, and the model, once this node is known to hold its state."""
    t = run.trainer
    strategy = strategies.build(run.strategy, t.precision)
    scaler = strategy.grad_scaler(env.device) if t.precision == "fp16-mixed" else None
    precision = Precision(t.precision, env.device, scaler)
    # Before anything is allocated: can this node hold the model's state under this strategy? (Where
    # the driver runs on this machine it refused already; the estimate is the summary's all the same.)
    as_built = lambda: precision.convert_model(build_model(run.composed.model))  # noqa: E731
    by_driver = memory.checked_on_driver(run.launcher)
    speaks = int(os.environ.get("LOCAL_RANK", "0")) == 0 and not by_driver  # one line per node, if any
    node = memory.Node(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), env.device, speaks)
    mode = MemoryCheck.off if by_driver else t.memory_check
    estimate = None
    if t.memory_check != MemoryCheck.off:
        shares = strategy.state_shares(env.world_size)
        estimate = memory.estimate_built(as_built, instantiate(run.composed.optimizer), shares, node.speaks)
    if estimate is not None:
        memory.judge(estimate, node, mode)
    model = precision.convert_model(strategy.build_model(lambda: build_model(run.composed.model)))
    if isinstance(model, nn.ModuleDict) and t.step_fn is None:
        raise UserError(
            "model builds several modules: set trainer.step_fn._target_ to a function "
            "(model, batch, loss_fn) -> loss that calls them"
        )
    # before the strategy wraps the model
    blocks.checkpoint_activations(model, t.activation_checkpointing, getattr(run.strategy, "block_classes", None))
    return ModelParts(strategy, precision, model, estimate.bytes_per_rank if estimate else None)


def choose_checkpoint(run: RunConfig, env: dist_env.DistEnv, run_dir: Path) -> tuple[Where | None, LocalCopies | None]:
    """The checkpoint this run starts from, if any. Rank 0 picks it (it alone warns about incomplete
    ones); every rank loads it. Every rank checks it first, each the checksums of its share of the
    files (no rank reads all of it), and with resume=auto the one before it is tried when it is
    damaged. The files a rank checked on an object store stay in the run dir (the LocalCopies
    returned, which the caller removes after the load): at the same world size they are those it
    loads, so it downloads them once. Collective."""
    ck = run.checkpoint
    root = checkpoint_root(run_dir, ck.dir, ck.storage_options)
    attempt = dist_env.attempt_number()
    tries: list[str] = []
    if env.is_main:
        found, note = choose_start(ck.resume, root, attempt, ck.storage_options)
        if note:
            print(f"dtf: {note}", flush=True)
        if found is not None:
            tries = [str(found)]
        if found is not None and (ck.resume == "auto" or attempt > 0):
            tries += [str(p) for p in committed(root) if p.name < found.name]  # newest first
    tries = dist_env.broadcast_from_main(tries)
    copies: LocalCopies | None = None
    try:
        for i, text in enumerate(tries):
            path = location(text, ck.storage_options)
            if isinstance(path, RemotePath):
                copies = LocalCopies(run_dir / f".resume-rank{env.rank}")  # (emptied of the one before's)
            mine = _share_damaged(path, env, copies)
            problems = [mine]
            if env.world_size > 1:
                problems = [""] * env.world_size
                torch.distributed.all_gather_object(problems, mine)
            problem = next((p for p in problems if p), "")
            if not problem:
                return path, copies
            if i + 1 == len(tries) and not (ck.resume == "auto" or attempt > 0):
                raise EveryRankUserError(f"checkpoint.resume={ck.resume} is not a complete checkpoint: {problem}")
            if env.is_main:
                before = "resuming from the one before it" if i + 1 < len(tries) else "starting fresh"
                print(f"dtf: warning: skipping checkpoint {path}: {problem}; {before}", file=sys.stderr, flush=True)
    except BaseException:
        if copies is not None:
            copies.remove()
        raise
    if copies is not None:
        copies.remove()
    return None, None


def _share_damaged(path: Where, env: dist_env.DistEnv, copies: LocalCopies | None) -> str:
    """This rank's share of the checkpoint's checksums (checkpoint.damaged), its files kept in
    copies; a store that fails while it reads them (not the checkpoint's fault) ends the run in one line."""
    try:
        return damaged(path, env.rank, env.world_size, copies)
    except Exception as e:
        if not isinstance(path, RemotePath):
            raise
        line = remote.diagnose(e, str(path), path.key, "checking the checkpoint's checksums")
        if line is None:
            raise
        raise UserError(line) from None


def setup_data(run: RunConfig, env: dist_env.DistEnv, recorded_partitions: int | None) -> DataSplits:
    """Training, validation and test batches (the objective checked against the splits there
    are); recorded_partitions: the canonical partitions of the checkpoint a resumed run starts
    from (Parquet)."""
    splits = loader.build_splits(run.data, env, seed=run.trainer.seed, recorded_partitions=recorded_partitions)
    splits = debug.limited(splits, run.trainer)
    objective_name(run, splits)
    t = run.trainer
    if splits.val is None and splits.test is None and (t.eval_every_n_steps is not None or t.eval_every_n_epochs < 1):
        key = "eval_every_n_steps" if t.eval_every_n_steps is not None else "eval_every_n_epochs"
        raise UserError(
            f"trainer.{key}={getattr(t, key)}: this data has no validation or test split to evaluate: give it one "
            "(data.val_fraction, a test split), or leave the key at its default"
        )
    return splits


def objective_name(run: RunConfig, splits: DataSplits) -> str:
    """trainer.objective as this run computes it (auto resolved)."""
    return resolve_objective(run.trainer.objective, splits.val is not None, splits.test is not None)


def assemble(
    run: RunConfig,
    env: dist_env.DistEnv,
    run_dir: Path,
    stop_request: StopRequest,
    parts: ModelParts,
    model: nn.Module,
    optimizer: Optimizer,
    splits: DataSplits,
    beat: Heartbeat | None = None,
) -> Trainer:
    """The Trainer over the wrapped model and its optimizer, with its components."""
    t, ck, cfg = run.trainer, run.checkpoint, run.composed
    checkpointer = Checkpointer(
        ck, checkpoint_root(run_dir, ck.dir, ck.storage_options), env, run.strategy.name, t.dist_timeout_s
    )
    control = StepControl(
        stop_request,
        checkpointer,
        env.world_size,
        every_n_steps=ck.stop_check_every_n_steps,
        every_s=ck.stop_check_every_s,
        is_main=env.is_main,
    )
    forward = step_forward(run, parts.precision, parts.model)
    logs = loggers.build(run, run_dir, env.is_main, env.world_size)
    objective = objective_name(run, splits)
    best_model = run_dir / run_summary.BEST_WEIGHTS_FILE if ck.keep_best else None
    validator = Validator(
        env,
        forward,
        Metrics.build(cfg.get("metrics"), env.device, cfg.get("loss")),
        splits.val,
        splits.test,
        settings=t,
        steps_per_epoch=t.steps_per_epoch(len(splits.train)),
        state=TrainState(),
        objective=objective,
        pruning=trial_pruning(run, objective, env),
        control=control,
        heartbeat=beat,
        loggers=logs,
        keep_best=(checkpointer, parts.strategy, best_model),
    )
    trainer = Trainer(
        t,
        env,
        parts.strategy,
        model,
        optimizer,
        schedule=lr_schedule(run, optimizer, env.world_size),
        forward=forward,
        train_data=splits.train,
        train_metrics=Metrics.build(cfg.get("metrics") if t.train_metrics else None, env.device, cfg.get("loss")),
        validator=validator,
        loggers=logs,
        control=control,
        heartbeat=beat,
    )
    trainer.model_state_estimate_bytes = parts.state_estimate_bytes
    return trainer


def step_forward(run: RunConfig, precision: Precision, model: nn.Module | None = None) -> Forward:
    """How a batch's loss is computed, in training and evaluation alike: trainer.step_fn, else the
    model's own step where it brings one (model=hf: dtf.models.hf.hf_step), else supervised_step;
    with the loss section, under the precision."""
    t = run.trainer
    loss_fn = TargetsLikeOutput(instantiate(run.composed.loss), label_source(run.data))
    step_fn = instantiate(t.step_fn) if t.step_fn else getattr(model, "step_fn", None) or supervised_step
    return Forward(step_fn, loss_fn, precision)


def lr_schedule(run: RunConfig, optimizer: Optimizer, world_size: int) -> schedule.LRSchedule:
    """The optimizer's LR scaled for the world size (trainer.lr_scaling), then warm-up and the
    user's scheduler over the run's steps."""
    t = run.trainer
    scale = schedule.lr_scale_factor(t.lr_scaling, elastic.scaling_world_size(run, world_size), t.grad_accum_steps)
    schedule.scale_lr(optimizer, scale)
    start_factor = t.warmup_start_factor or schedule.default_warmup_start_factor(scale, t.warmup_steps)
    user_scheduler = instantiate(run.composed.scheduler) if run.composed.get("scheduler") else None
    return schedule.LRSchedule(
        optimizer,
        lambda total: schedule.build_scheduler(optimizer, user_scheduler, total, t.warmup_steps, start_factor),
    )


def label_source(data: DataConfig) -> str:
    """Where the labels come from, as error messages name it."""
    if isinstance(data, ParquetDataConfig):
        return f"data.label_column={data.label_column}"
    if isinstance(data, TextDataConfig):
        return "data.path (labels: the token ids)"
    return "data.dataset (its targets)"


def trial_pruning(run: RunConfig, objective: str, env: dist_env.DistEnv) -> Pruning | None:
    """A trial of hydra/sweeper=dtf (its `trial` section) reports to its study and may be pruned."""
    if run.trial is None:
        return None
    from dtf.sweep.study import TrialPruning  # Optuna only where a sweep runs

    return TrialPruning(run.trial, objective, env)


def announce(run: RunConfig, trainer: Trainer, run_dir: Path, resumed: bool) -> None:
    """Rank 0's start line: what runs where, and what the user should know before it does."""
    env, t = trainer.env, run.trainer
    if not env.is_main:
        return
    scale = schedule.lr_scale_factor(t.lr_scaling, elastic.scaling_world_size(run, env.world_size), t.grad_accum_steps)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    change = trainer.membership_change
    if change is not None:
        old, new = change["old_world_size"], change["new_world_size"]
        how = "a node joined" if new > old else "a node left"
        again = change["steps_recomputed"]
        redo = f", {again} step(s) to do again" if again else ""
        print(f"dtf: membership change ({how}): world size {old} -> {new} from step {change['step']}{redo}", flush=True)
    if restart and not (change is not None and change["new_world_size"] > change["old_world_size"]):
        # the agent restarted the ranks after a failure: say so, once (a node that joins restarts them too)
        where = f"resuming from step {trainer.state.step}" if resumed else "starting over (no checkpoint)"
        print(
            f"dtf: restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} (launcher.max_restarts): "
            f"{previous_failure(run_dir, restart)}; {where}",
            flush=True,
        )
    print(
        f"dtf: {env.world_size} rank(s), strategy={run.strategy.name}, device={env.device}, "
        f"{loader.describe(trainer.train_data)}, {trainer.total_steps} optimizer steps, "
        f"lr x{scale:g} ({t.lr_scaling.value} scaling){between_nodes(env)}; run dir {run_dir}",
        flush=True,
    )
    sizes = elastic.plan(run)
    if sizes is not None and sizes.elastic:
        print(f"dtf: {sizes.describe()}", flush=True)
    note = lone_rank_threads_note() if env.world_size == 1 else None
    if note:
        print(f"dtf: {note}", flush=True)
    selects = [
        name
        for name, on in [
            ("a search's trial (hydra/sweeper=dtf)", run.trial is not None),
            ("trainer.early_stopping", t.early_stopping.patience is not None),
            ("checkpoint.keep_best", run.checkpoint.keep_best > 0),
        ]
        if on
    ]
    objective = trainer.validator.selection.objective
    if objective.startswith("test/") and selects:
        print(
            f"dtf: warning: trainer.objective={objective} chooses ({', '.join(selects)}): {TEST_BIAS_WARNING}",
            flush=True,
        )
    if t.warmup_steps >= trainer.schedule.plan.total:
        print(
            f"dtf: warning: trainer.warmup_steps={t.warmup_steps} covers all {trainer.schedule.plan.total} "
            "optimizer steps: the LR never reaches its target",
            flush=True,
        )


def publish(run_dir: Path, root: RemotePath) -> None:
    """Rank 0, at the end of a run whose checkpoint.dir is on an object store: the run's results
    (model.pt, best_model.pt, summary.json, the Hugging Face exports) copied there beside the
    checkpoints, each replacing the one before; the run dir keeps its own. summary.json last: a
    reader that finds it finds the rest of this run's results."""
    folders = [n for n in (hf_export.EXPORT_DIR, hf_export.BEST_EXPORT_DIR) if (run_dir / n).is_dir()]
    files = [n for n in (run_summary.WEIGHTS_FILE, run_summary.BEST_WEIGHTS_FILE) if (run_dir / n).is_file()]
    files.append(run_summary.SUMMARY_FILE)
    try:
        for name in folders:
            (root / name).rmtree()
            root.fs.put(f"{run_dir / name}/", (root / name).path, recursive=True)
        for name in files:
            root.fs.put_file(str(run_dir / name), (root / name).path)
    except Exception as e:
        line = remote.diagnose(e, root.url, "checkpoint.dir", "copying the run's results there")
        if line is None:
            raise
        raise UserError(f"{line}; they are in {run_dir}") from None
    print(f"dtf: results copied to {root}: {', '.join([*(f'{n}/' for n in folders), *files])}", flush=True)


def between_nodes(env: dist_env.DistEnv) -> str:
    """Where ranks on several machines meet: the network interface their process groups and stores
    listen on (on one machine, loopback alone: nothing to say)."""
    if env.world_size <= int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)):
        return ""
    from dtf.dist.network import interface_address

    interface = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    if not interface:
        return f", nodes meet at {os.environ.get('MASTER_ADDR', '?')}"
    return f", nodes connected over {interface} ({interface_address(interface) or '?'})"


def previous_failure(run_dir: Path, attempt: int) -> str:
    """Which rank failed in the attempt before this one (a restart's reason), from its record."""
    failure = failures.first(run_dir, attempt - 1)
    if failure is None:
        return "a rank died without an error of its own (killed by a signal?)"
    return f"rank {failure.rank} failed ({failure.message})"


def finish(run: RunConfig, trainer: Trainer, run_dir: Path, stop_request: StopRequest) -> RunResult | None:
    """How the fit ended: Stopped where the ranks agreed to stop, else the run's record (a
    collective; rank 0 writes it and returns it as Finished)."""
    if trainer.stopped_at_step is not None:
        trainer.loggers.close("stopped")  # what was logged so far is kept; the resumed run appends to it
        step = trainer.stopped_at_step
        return Stopped(stop_request.signal_name, step, str(trainer.checkpointer.path_of(step)))
    summary = run_summary.finish(run, trainer, run_dir)
    if summary is not None and run.checkpoint.export_hf:  # rank 0; fit() committed the final checkpoint
        hf_export.export_at_end(run_dir, trainer.checkpointer.root, run.checkpoint.keep_best > 0, trainer.beat)
    if summary is not None and isinstance(trainer.checkpointer.root, RemotePath):
        publish(run_dir, trainer.checkpointer.root)
    trainer.loggers.close("finished" if trainer.validator.pruned_at_epoch is None else "pruned")
    return Finished(summary.as_dict()) if summary is not None else None
