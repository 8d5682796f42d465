"""What every rank runs: join the group, build model/data/optimizer, train, report.

`worker_main(cfg, run_dir)` takes the config already resolved and frozen on the driver; it
never looks at sys.argv, so multirun jobs and any launcher can ship it as it is.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dtf import failures
from dtf import strategy as strategies
from dtf.config.schema import PetastormDataConfig, TrialConfig
from dtf.config.typed import DataConfig, RunConfig, section, typed
from dtf.data import loader
from dtf.dist import env as dist_env
from dtf.errors import UserError
from dtf.results import Finished, RunResult, Stopped
from dtf.strategy import memory
from dtf.train import blocks, schedule
from dtf.train import summary as run_summary
from dtf.train.checkpoint import Checkpointer, choose_start, recorded_position
from dtf.train.control import StepControl
from dtf.train.loss import TargetsLikeOutput
from dtf.train.metrics import Metrics
from dtf.train.precision import Precision
from dtf.train.progress import TensorBoard
from dtf.train.stop import StopRequest
from dtf.train.trainer import Pruning, Trainer, supervised_step


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def limit_threads() -> None:
    """Ranks sharing a machine split its cores instead of fighting over them."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def build_model(cfg: DictConfig) -> nn.Module:
    """One module by _target_, or a mapping of names to module configs (several modules, as in a GAN)."""
    if "_target_" in cfg:
        return instantiate(cfg)
    return nn.ModuleDict({str(name): instantiate(sub) for name, sub in cfg.items()})


def worker_main(cfg: DictConfig, run_dir: str, payload: bytes | None = None) -> RunResult | None:
    """One rank's run. Returns Finished on rank 0 and None elsewhere, or Stopped on every rank
    when a stop signal ended the run early. payload: dtf.run_function's function and objects."""
    run = typed(cfg)
    for key, value in run.launcher.env.items():
        os.environ.setdefault(str(key), str(value))
    limit_threads()
    # From the start: a stop signal that arrives while the run is still setting up is not lost.
    stop_request = StopRequest(run.checkpoint.stop_signals, sigint_kills=True)
    t = run.trainer
    env = dist_env.init(t.device, t.dist_backend, t.dist_timeout_s)
    if env.world_size > int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)):
        # Several nodes, each of whose drivers composed a config: all run rank 0's.
        cfg = agree_on_config(cfg, env)
        run = typed(cfg)
        t = run.trainer
    # Under an external torchrun every rank composed its own config; rank 0's run dir wins.
    directory = Path(dist_env.broadcast_from_main(run_dir))
    if env.world_size > int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)):
        from dtf.launch.nodes import record_nodes

        record_nodes(directory, env)
    if payload is not None or cfg.trainer.get("fn") is not None:  # trainer=function, dtf.run_function
        from dtf.train import function

        stop_request.restore()  # the function owns its loop: no step to stop at, signals act as usual
        seed_everything(t.seed)  # as a plain run of the function would start (the same seed on every rank)
        result: RunResult | None = function.run(cfg, env, directory, function.load(payload))
    else:
        result = train(cfg, env, directory, stop_request)
    stop_request.restore()
    # Only on success: after an error the group must stay up until the error is recorded, or the
    # peers see "connection closed" first and the report blames the wrong rank.
    dist_env.destroy()
    return result


def agree_on_config(cfg: DictConfig, env: dist_env.DistEnv) -> DictConfig:
    """Rank 0's config, on every rank; a node whose own config differed says so, once."""
    main: DictConfig = dist_env.broadcast_from_main(cfg)
    if not env.is_main and int(os.environ.get("LOCAL_RANK", "0")) == 0 and _shared(main) != _shared(cfg):
        print(
            f"dtf: this node's config differs from rank 0's (node {os.environ.get('GROUP_RANK', '?')}): "
            "it runs rank 0's, as every node does",
            flush=True,
        )
    return main


def _shared(cfg: DictConfig) -> str:
    """Digest of what the nodes must agree on: all but the keys that name the node itself."""
    from dtf.train.summary import config_sha256

    mine = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(mine, dict)
    for key in ("node_rank", "network_interface"):
        mine["launcher"].pop(key, None)
    return config_sha256(OmegaConf.create(mine))


def label_source(data: DataConfig) -> str:
    """Where the labels come from, as error messages name it."""
    if isinstance(data, PetastormDataConfig):
        return f"data.label_column={data.label_column}"
    return "data.dataset (its targets)"


def train(
    cfg: DictConfig, env: dist_env.DistEnv, run_dir: Path, stop_request: StopRequest | None = None
) -> RunResult | None:
    run = typed(cfg)
    t, ck = run.trainer, run.checkpoint
    if t.deterministic:
        # cuBLAS is deterministic only with a fixed workspace, which must be set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    # Same seed everywhere for the model's initial weights (DDP also broadcasts rank 0's) ...
    seed_everything(t.seed)
    strategy = strategies.build(run.strategy, t.precision)
    scaler = strategy.grad_scaler(env.device) if t.precision == "fp16-mixed" else None
    precision = Precision(t.precision, env.device, scaler)
    # Before anything is allocated: can this node hold the model's state under this strategy?
    as_built = lambda: precision.convert_model(build_model(cfg.model))  # noqa: E731
    estimate = memory.check(as_built, strategy, instantiate(cfg.optimizer), env, t.memory_check)
    model = precision.convert_model(strategy.build_model(lambda: build_model(cfg.model)))
    if isinstance(model, nn.ModuleDict) and t.step_fn is None:
        raise UserError(
            "model builds several modules: set trainer.step_fn._target_ to a function "
            "(model, batch, loss_fn) -> loss that calls them"
        )
    blocks.checkpoint_activations(model, t.activation_checkpointing)  # before the strategy wraps the model
    # Rank 0 picks the checkpoint (it alone warns about incomplete ones); all ranks load it. Before
    # the data: a resumed run's Parquet sequence is the one its checkpoint recorded.
    found, note = choose_start(ck.resume, run_dir / ck.dir, dist_env.attempt_number()) if env.is_main else (None, None)
    if note:
        print(f"dtf: {note}", flush=True)
    resume = dist_env.broadcast_from_main(str(found) if found else None)
    recorded = recorded_position(Path(resume)).get("canonical_partitions") if resume is not None else None
    train_data, eval_data = loader.build(run.data, env, seed=t.seed, recorded_partitions=recorded)
    if eval_data is None and t.objective.startswith("test/") and t.objective != "test/loss":
        raise UserError(
            f"trainer.objective={t.objective}: this data has no test set; judge the run by train/loss "
            "(or a train/<metric> with trainer.train_metrics=true), or give the data a test split"
        )
    unwrapped = model
    model, optimizer = strategy.setup(model, instantiate(cfg.optimizer), env)
    # After the wrapping: DDP's and FSDP's hooks stay outside the compiled code.
    blocks.compile_model(unwrapped, t.compile, getattr(run.strategy, "block_classes", None))
    # ... and a different stream per rank for what happens during training (dropout, augmentation).
    seed_everything(t.seed + env.rank)

    scale = schedule.lr_scale_factor(t.lr_scaling, env.world_size, t.grad_accum_steps)
    schedule.scale_lr(optimizer, scale)
    start_factor = t.warmup_start_factor or schedule.default_warmup_start_factor(scale, t.warmup_steps)
    user_scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    lr_schedule = schedule.LRSchedule(
        optimizer,
        lambda total: schedule.build_scheduler(optimizer, user_scheduler, total, t.warmup_steps, start_factor),
    )
    tb = TensorBoard(run_dir, enabled=t.tensorboard and env.is_main)
    checkpointer = Checkpointer(ck, run_dir / ck.dir, env, run.strategy.name)
    trainer = Trainer(
        t,
        env,
        strategy,
        model,
        optimizer,
        schedule=lr_schedule,
        loss_fn=TargetsLikeOutput(instantiate(cfg.loss), label_source(run.data)),
        step_fn=instantiate(t.step_fn) if t.step_fn else supervised_step,
        train_data=train_data,
        eval_data=eval_data,
        tensorboard=tb,
        checkpointer=checkpointer,
        metrics=Metrics.build(cfg.get("metrics"), env.device),
        train_metrics=Metrics.build(cfg.get("metrics") if t.train_metrics else None, env.device),
        control=StepControl(
            stop_request or StopRequest(()),
            checkpointer,
            env.world_size,
            every_n_steps=ck.stop_check_every_n_steps,
            every_s=ck.stop_check_every_s,
            is_main=env.is_main,
        ),
        precision=precision,
        pruning=trial_pruning(cfg, run, eval_data is not None, env),
    )
    trainer.model_state_estimate_bytes = estimate.bytes_per_rank if estimate else None
    if resume is not None:
        trainer.resume_from(Path(resume))
        if env.is_main:
            print(f"dtf: resumed from {resume} (step {trainer.state.step})", flush=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and env.is_main:  # the agent restarted the ranks after a failure: say so, once
        where = f"resuming from step {trainer.state.step}" if resume is not None else "starting over (no checkpoint)"
        print(
            f"dtf: restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} (launcher.max_restarts): "
            f"{previous_failure(run_dir, restart)}; {where}",
            flush=True,
        )
    if env.is_main:
        print(
            f"dtf: {env.world_size} rank(s), strategy={run.strategy.name}, device={env.device}, "
            f"{loader.describe(train_data)}, {trainer.total_steps} optimizer steps, "
            f"lr x{scale:g} ({t.lr_scaling.value} scaling); run dir {run_dir}",
            flush=True,
        )
        if t.warmup_steps >= trainer.schedule.plan.total:
            print(
                f"dtf: warning: trainer.warmup_steps={t.warmup_steps} covers all {trainer.schedule.plan.total} "
                "optimizer steps: the LR never reaches its target",
                flush=True,
            )

    trainer.fit()
    if trainer.stopped_at_step is not None:
        tb.close()  # what was logged so far is kept; the resumed run appends to the same run dir
        step = trainer.stopped_at_step
        signal_name = stop_request.signal_name if stop_request else None
        return Stopped(signal_name, step, str(checkpointer.path_of(step)))
    summary = run_summary.finish(run, cfg, trainer, run_dir)
    tb.close()
    return Finished(summary) if summary is not None else None


def trial_pruning(cfg: DictConfig, run: RunConfig, has_test_set: bool, env: dist_env.DistEnv) -> Pruning | None:
    """A trial of hydra/sweeper=dtf (its `trial` section) reports to its study and may be pruned."""
    if cfg.get("trial") is None:
        return None
    from dtf.sweep.study import TrialPruning  # Optuna only where a sweep runs

    return TrialPruning(section(cfg, "trial", TrialConfig), run_summary.objective_of(run, has_test_set), env)


def previous_failure(run_dir: Path, attempt: int) -> str:
    """Which rank failed in the attempt before this one (a restart's reason), from its record."""
    failure = failures.first(run_dir, attempt - 1)
    if failure is None:
        return "a rank died without an error of its own (killed by a signal?)"
    return f"rank {failure.rank} failed ({failure.message})"
