"""trainer=function: your own training function, made distributed (Maggy's `lagom`, HorovodRunner's
`run`). In mode "function" (the default) dtf calls on every rank

    fn(module, hparams, train_set, test_set) -> float | dict[str, float] | None

with no distributed code in it:

- `module(**kwargs)` builds the model (the configured model, or the class given to
  dtf.run_function, with kwargs over its settings) and returns it wrapped by the configured
  strategy (dtf.train.function_model). An optimizer the function builds over its parameters
  steps what this rank holds (with ZeRO stage 1: an element-wise slice).
- `train_set` is this rank's share of the training set: equal on every rank (strided, the last
  len % world_size samples left out), so every DataLoader the function builds over it yields the
  same number of batches on every rank and no rank waits in a collective for a peer that is done.
  A DistributedSampler the function builds over it gets the whole set (dtf.train.function_data).
- `test_set` is this rank's share of the test set: every sample on exactly one rank. The value
  the function returns is averaged over the ranks weighted by the samples each saw (a sum and a
  count, not a mean of means): exact for any per-sample mean (a loss, an accuracy). What is not
  a per-sample mean (a mean of batch means) the function reports exactly with
  dtf.report(name, total, count), summed over the ranks.
- `val_set` (a keyword argument, given only where the data has a validation split: data.val_fraction,
  a data.dataset that builds one, or dtf.run_function(val_set=...)): this rank's share of it, as
  test_set's. Values returned under a name that begins with "val/" are averaged with this rank's
  validation samples as weight (the others with its test samples'); trainer.objective=val/loss
  judges the run by the returned "val/loss".
- In eval mode (model.eval()) the model's forward needs no collective, so ranks may run different
  numbers of test batches.

In mode "torchrun" dtf calls fn(*args, **kwargs) on every rank with torchrun's environment
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) and no process group: the function
makes its own (torch.distributed, or dtf.horovod's hvd.init()), as under TorchDistributor or
HorovodRunner, and rank 0's return value is the run's.

Checkpointing is not offered in these modes (the function owns its loop); see docs/python-api.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import Dataset

from dtf import strategy as strategies
from dtf.config.typed import RunConfig
from dtf.data.loader import Datasets, datasets_of
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.results import Finished
from dtf.strategy import auto as auto_strategy
from dtf.train import loggers
from dtf.train import summary as run_summary
from dtf.train.function_data import Shard, watching_samplers
from dtf.train.function_model import ModuleFactory, StepCounter
from dtf.train.rng import seed_everything
from dtf.train.summary import FunctionSummary, RankFigures, TorchrunSummary

FUNCTION, TORCHRUN = "function", "torchrun"
# What dtf.run_function composes into trainer.fn: its function travels as the payload
SHIPPED = "dtf.train.function.shipped_by_run_function"


def shipped_by_run_function(*args: Any, **kwargs: Any) -> None:
    raise UserError(
        "trainer.fn: this run's function was shipped by dtf.run_function from Python and is not in its config: "
        "run it again from Python, or name your function with trainer.fn._target_=mypkg.train"
    )


@dataclass
class Payload:
    """What dtf.run_function ships to the ranks (cloudpickled): the function and the objects a
    config cannot name. None: the config's (trainer.fn, model, data.dataset, trainer.hparams).
    mode "torchrun": fn(*args, **kwargs), with its own process group."""

    fn: Callable[..., Any]
    module: Callable[..., nn.Module] | None = None
    train_set: Dataset | None = None
    test_set: Dataset | None = None
    hparams: dict[str, Any] = field(default_factory=dict)
    mode: str = FUNCTION
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    val_set: Dataset | None = None


def load(payload: bytes | None) -> Payload | None:
    if payload is None:
        return None
    import cloudpickle

    loaded = cloudpickle.loads(payload)
    assert isinstance(loaded, Payload)
    return loaded


def dump(payload: Payload) -> bytes:
    """By value where it must be: a function or class defined in a notebook or a script's
    __main__ does not exist in a rank's process, so it travels as code (as HorovodRunner's does)."""
    import cloudpickle

    return bytes(cloudpickle.dumps(payload))


# ---- dtf.report ------------------------------------------------------------------------------

_reports: dict[str, list[float]] | None = None  # name -> [total, count] while a function runs here


def report(name: str, total: float, count: float) -> None:
    """From inside a training function: the value `name` is total / count over all ranks, each
    rank adding its total and count (a loss summed over its test samples, and their number).
    Reporting the same name again adds to it."""
    if _reports is None:
        raise UserError(
            "dtf.report(name, total, count) is for a training function dtf runs (dtf.run_function, trainer=function)"
        )
    entry = _reports.setdefault(str(name), [0.0, 0.0])
    entry[0] += float(total)
    entry[1] += float(count)


@contextlib.contextmanager
def _collecting_reports() -> Iterator[dict[str, list[float]]]:
    global _reports
    _reports = {}
    try:
        yield _reports
    finally:
        _reports = None


# ---- one rank's run --------------------------------------------------------------------------


def run(run: RunConfig, env: DistEnv, run_dir: Path, payload: Payload | None) -> Finished | None:
    """One rank's trainer=function run; rank 0 returns the summary."""
    seed_everything(run.trainer.seed)  # as a plain run of the function would start (the same seed on every rank)
    fn, build, train_set, val_set, test_set, hparams = _inputs(run, payload)
    if len(train_set) < env.world_size:  # type: ignore[arg-type]
        raise UserError(
            f"the training set has {len(train_set)} samples for {env.world_size} ranks: "  # type: ignore[arg-type]
            "give it at least one sample per rank"
        )
    if auto_strategy.wants_choice(run.strategy):  # mics' partition_group_size=auto (preflight refuses strategy=auto)
        t = run.trainer
        concrete, _ = auto_strategy.resolve(run.strategy, env, None, None, t.memory_check, t.precision)
        run = dataclasses.replace(run, strategy=concrete)
    strategy = strategies.build(run.strategy, run.trainer.precision)
    factory = ModuleFactory(build, strategy, env)
    train_shard = Shard(train_set, env.rank, env.world_size, equal=True, name="train_set")
    test_shard = (
        Shard(test_set, env.rank, env.world_size, equal=False, name="test_set") if test_set is not None else None
    )
    val_shard = Shard(val_set, env.rank, env.world_size, equal=False, name="val_set") if val_set is not None else None
    with_val = {"val_set": val_shard} if val_shard is not None else {}
    if with_val and not _takes_val_set(fn):
        raise UserError(
            f"the data has a validation split but {_name(fn, run, payload)} takes no val_set: add a val_set parameter "
            "(fn(module, hparams, train_set, test_set, val_set)), or give the data none (data.val_fraction=0)"
        )
    if env.is_main:
        print(
            f"dtf: {env.world_size} rank(s), strategy={run.strategy.name}, device={env.device}, your function "
            f"{_name(fn, run, payload)}: {len(train_shard)} training samples per rank; run dir {run_dir}",
            flush=True,
        )
    counter = StepCounter(factory)
    # Rank 0's loggers get what a function run has: its result's figures at its last step, and its files.
    tracked = loggers.build(run, run_dir, env.is_main, env.world_size)
    logged = SimpleNamespace(step=0, mlflow_run_id=None, wandb_run_id=None)  # what loggers read of TrainState
    tracked.start(logged)
    started = time.perf_counter()
    shards = [s for s in (train_shard, test_shard, val_shard) if s is not None]
    try:
        try:
            with _collecting_reports() as reports, watching_samplers(shards, env.is_main):
                returned = fn(factory, dict(hparams), train_shard, test_shard, **with_val)
        finally:
            counter.close()
            factory.close()
        seconds = time.perf_counter() - started
        weight = test_shard.used_on_this_rank() if test_shard is not None else 1
        val_weight = val_shard.used_on_this_rank() if val_shard is not None else weight
        result = _combined(_averaged(returned, weight, env, val_weight), _reported(reports, env))
        done = _finish(run, env, run_dir, factory, strategy, result, counter, seconds, len(train_set))  # type: ignore[arg-type]
    except BaseException:
        tracked.close("failed")
        raise
    if done is not None:
        logged.step = done.summary["global_step"]
        figures = result if isinstance(result, dict) else {"result": result}
        tracked.scalars(logged.step, figures)
        settings = {"world_size": env.world_size, "strategy": run.strategy.name, **dict(hparams)}
        plain = {k: v for k, v in settings.items() if isinstance(v, (int, float, str, bool))}  # what hparams records
        tracked.hparams(plain, {"objective": done.summary["objective"]})
        tracked.finish(run_dir)
    tracked.close("finished")
    return done


def _inputs(
    run: RunConfig, payload: Payload | None
) -> tuple[Callable[..., Any], Callable[..., nn.Module], Dataset, Dataset | None, Dataset | None, Mapping[str, Any]]:
    """(fn, the model's builder, train, val and test sets, hparams)."""
    cfg = run.composed  # the function, model and datasets are the user's, built by _target_
    hparams = {str(k): v for k, v in run.trainer.hparams.items()}
    if payload is not None:
        if payload.module is not None:
            build: Callable[..., nn.Module] = payload.module
        else:
            build = _from_config(cfg.model)
        if payload.train_set is not None:
            sets = Datasets(payload.train_set, payload.val_set, payload.test_set)
        else:
            sets = datasets_of(run.data)  # type: ignore[arg-type]
        return payload.fn, build, sets.train, sets.val, sets.test, {**hparams, **payload.hparams}
    sets = datasets_of(run.data)  # type: ignore[arg-type]
    fn: Callable[..., Any] = instantiate(cfg.trainer.fn)
    return fn, _from_config(cfg.model), sets.train, sets.val, sets.test, hparams


def _takes_val_set(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: let the call say
        return True
    return any(p.name == "val_set" or p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def _name(fn: Any, run: RunConfig, payload: Payload | None) -> str:
    if payload is None and run.trainer.fn is not None:
        return str(run.trainer.fn["_target_"])
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _from_config(model_cfg: DictConfig) -> Callable[..., nn.Module]:
    def build(**kwargs: Any) -> nn.Module:
        model: nn.Module = instantiate(model_cfg, **kwargs)
        return model

    return build


def _averaged(returned: Any, count: int, env: DistEnv, val_count: int | None = None) -> float | dict[str, float] | None:
    """The function's value(s), averaged over the ranks with this rank's test samples as weight
    (its validation samples, val_count, for a name that begins with "val/")."""
    if isinstance(returned, Mapping):
        names = sorted(returned)
        values = [returned[k] for k in names]
    elif returned is None:
        names, values = [], []
    else:
        names, values = [], [returned]
    try:
        numbers = [float(v) for v in values]
    except (TypeError, ValueError):
        raise UserError(
            f"trainer.fn returned {returned!r}: return a number (e.g. the test loss) or a dict of numbers"
        ) from None
    weights = [float(val_count if val_count is not None and n.startswith("val/") else count) for n in names]
    weights = weights or [float(count)]  # a number: the test samples'
    sums = torch.tensor([*(v * w for v, w in zip(numbers, weights, strict=True)), *weights], dtype=torch.float64)
    kinds = [None] * env.world_size
    kind = "none" if returned is None else names
    dist.all_gather_object(kinds, kind)  # every rank must return the same kind of value
    if any(k != kind for k in kinds):
        raise UserError(
            f"trainer.fn returned different keys on different ranks ({kinds}): return the same on every rank"
        )
    if returned is None:
        return None
    dist.all_reduce(sums)
    averaged = (sums[: len(numbers)] / sums[len(numbers) :]).tolist()
    return dict(zip(names, averaged, strict=True)) if names else averaged[0]


def _reported(reports: dict[str, list[float]], env: DistEnv) -> dict[str, float]:
    """dtf.report's values: each name's totals and counts summed over the ranks, divided."""
    names = sorted(reports)
    every: list[Any] = [None] * env.world_size
    dist.all_gather_object(every, names)
    if any(n != names for n in every):
        raise UserError(
            f"dtf.report: the ranks reported different names ({every}): report the same names on every rank"
        )
    sums = torch.tensor([x for n in names for x in reports[n]], dtype=torch.float64)
    dist.all_reduce(sums)
    return {n: float(sums[2 * i] / sums[2 * i + 1]) for i, n in enumerate(names)}


def _combined(returned: float | dict[str, float] | None, reported: dict[str, float]) -> float | dict[str, float]:
    if not reported:
        if returned is None:
            raise UserError("trainer.fn returned nothing: return a number or a dict of numbers, or dtf.report values")
        return returned
    if isinstance(returned, float):
        raise UserError(
            "trainer.fn returned a number and reported values with dtf.report: return a dict (or nothing) beside them"
        )
    both = sorted(set(returned or {}) & set(reported))
    if both:
        raise UserError(f"trainer.fn returned and reported {both}: give each value one name")
    return {**(returned or {}), **reported}


def _finish(
    run: RunConfig,
    env: DistEnv,
    run_dir: Path,
    factory: ModuleFactory,
    strategy: strategies.Strategy,
    result: float | dict[str, float],
    counter: StepCounter,
    seconds: float,
    num_samples: int,
) -> Finished | None:
    states = [strategy.full_state_dict(m) for m in factory.models]  # an all-gather for sharded models
    digests = [run_summary.params_sha256(state) for state in states]
    local = RankFigures(
        counter.steps,
        ",".join(digests),
        run_summary.peak_rss_bytes(),
        model_state_bytes=counter.model_state_bytes,
        optimizer_state_bytes=counter.state_bytes(),
    )
    ranks = run_summary.from_every_rank(local, env)
    if not env.is_main:
        return None
    # The model the function built (the last one, if it built several), as the loop exports it.
    exported = run.trainer.export_weights and bool(states)
    summary = FunctionSummary(
        **run_summary.shared_fields(run, ranks, run_dir),
        result=result,
        objective=_objective(run, result),
        objective_name=objective_key(run) if isinstance(result, dict) else "result",
        global_step=ranks[0].steps,
        optimizer_state_bytes=[r.optimizer_state_bytes for r in ranks],
        model_state_bytes=[r.model_state_bytes for r in ranks],
        train_seconds=seconds,
        data_samples=num_samples,
        data_dropped_per_epoch=num_samples % env.world_size,
        weights_file=run_summary.WEIGHTS_FILE if exported else None,
    )
    if exported:
        torch.save(states[-1], run_dir / run_summary.WEIGHTS_FILE)
    summary.write(run_dir)
    print(
        f"dtf: your function returned {result} (averaged over {env.world_size} rank(s)); "
        f"{ranks[0].steps} optimizer steps per rank; summary {run_dir / run_summary.SUMMARY_FILE}",
        flush=True,
    )
    return Finished(summary.as_dict())


def objective_key(run: RunConfig) -> str:
    """The returned value trainer.objective names: auto is the function's test/loss."""
    return "test/loss" if run.trainer.objective == "auto" else run.trainer.objective


def _objective(run: RunConfig, result: float | dict[str, Any]) -> float:
    """The value trainer.objective names among the function's returned values (its only one, if one)."""
    if not isinstance(result, dict):
        return float(result)
    objective_name = objective_key(run).partition("/")[2]
    if objective_key(run) in result:  # a value returned under its full name, e.g. "val/loss"
        return float(result[objective_key(run)])
    if objective_name not in result:
        raise UserError(
            f"trainer.objective={objective_key(run)}: the function returned {sorted(result)}; name one of "
            f"them, e.g. trainer.objective=test/{sorted(result)[0]}"
        )
    return float(result[objective_name])


# ---- mode "torchrun" -------------------------------------------------------------------------


def run_torchrun(run: RunConfig, run_dir: Path, payload: Payload) -> Finished | None:
    """fn(*args, **kwargs) on this rank, which the function's own init_process_group (or
    hvd.init()) joins to the others; rank 0 returns Finished with its return value under
    "returned". A process group the function leaves behind is ended here: a Spark executor's
    Python worker runs the next task, which must not find this one's group."""
    import os

    rank = int(os.environ.get("RANK", "0"))
    counter = StepCounter()
    started = time.perf_counter()
    try:
        returned = payload.fn(*payload.args, **payload.kwargs)
    finally:
        counter.close()
        _end_leftover_group()
    if rank != 0:
        return None
    summary = TorchrunSummary(
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        result=run_summary.as_json(returned),
        objective=_torchrun_objective(run, returned),
        objective_name=objective_key(run) if isinstance(returned, Mapping) else "result",
        objective_mode=run.trainer.objective_mode.value,
        global_step=counter.steps,
        train_seconds=time.perf_counter() - started,
        launcher=run.launcher.name,
        run_dir=str(run_dir),
    )
    summary.write(run_dir)
    print(
        f"dtf: {summary.world_size} rank(s) ran {_name(payload.fn, run, payload)}; rank 0 returned "
        f"{_shortened(repr(returned))}; summary {run_dir / run_summary.SUMMARY_FILE}",
        flush=True,
    )
    return Finished({**summary.as_dict(), "returned": returned})


def _shortened(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _torchrun_objective(run: RunConfig, returned: Any) -> float | None:
    value = returned.get(objective_key(run).partition("/")[2]) if isinstance(returned, Mapping) else returned
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _end_leftover_group() -> None:
    import sys

    horovod = sys.modules.get("dtf.horovod")
    if horovod is not None:
        horovod.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
