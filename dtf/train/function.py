"""trainer=function: your own training function, made distributed (Maggy's `lagom`, HorovodRunner's
`run`). On every rank dtf calls

    fn(module, hparams, train_set, test_set) -> float | dict[str, float]

with no distributed code in it:

- `module(**kwargs)` builds the model (the configured model, or the class given to
  dtf.run_function, with kwargs over its settings) and returns it wrapped by the configured
  strategy. An optimizer the function builds over its parameters steps what this rank holds
  (with ZeRO stage 1: the parameters this rank owns, ParameterOwners).
- `train_set` is this rank's share of the training set: equal on every rank (strided, the last
  len % world_size samples left out), so every DataLoader the function builds over it yields the
  same number of batches on every rank and no rank waits in a collective for a peer that is done.
- `test_set` is this rank's share of the test set: every sample on exactly one rank. The value
  the function returns is averaged over the ranks weighted by those shares (a sum and a count, not
  a mean of means): exact for any per-sample mean (a loss, an accuracy).
- In eval mode (model.eval()) the model's forward needs no collective, so ranks may run different
  numbers of test batches: a sharded model (fsdp, mics, zero stage 2-3) is gathered once when
  eval() is called and freed again by train(); DDP skips its forward-time buffer sync.

Checkpointing is not offered in this mode (the function owns its loop); see docs/python-api.md.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import Dataset

from dtf import strategy as strategies
from dtf.config.typed import RunConfig
from dtf.data.loader import split_datasets
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.results import Finished
from dtf.strategy.base import no_optimizer
from dtf.train import summary as run_summary
from dtf.train.rng import seed_everything
from dtf.train.summary import FunctionSummary, RankFigures


@dataclass
class Payload:
    """What dtf.run_function ships to the ranks (cloudpickled): the function and the objects a
    config cannot name. None: the config's (trainer.fn, model, data.dataset, trainer.hparams)."""

    fn: Callable[..., Any]
    module: Callable[..., nn.Module] | None = None
    train_set: Dataset | None = None
    test_set: Dataset | None = None
    hparams: dict[str, Any] = field(default_factory=dict)


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


class Shard(Dataset):
    """This rank's samples of a dataset: indices rank, rank + world, rank + 2 world, ..."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int, equal: bool) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        end = n - n % world_size if equal else n
        self.dataset = dataset
        self.indices = range(rank, end, world_size)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.indices[i]]


class ModuleFactory:
    """`module(**kwargs)` inside the function: the model, built and wrapped by the strategy."""

    def __init__(self, build: Callable[..., nn.Module], strategy: strategies.Strategy, env: DistEnv) -> None:
        self._build, self._strategy, self._env = build, strategy, env
        self.models: list[nn.Module] = []
        self.owners: list[ParameterOwners] = []

    def __call__(self, **kwargs: Any) -> nn.Module:
        from dtf.strategy.ddp import DDPStrategy
        from dtf.strategy.zero1 import Zero1Strategy

        model = self._strategy.build_model(lambda: self._build(**kwargs))
        if isinstance(self._strategy, Zero1Strategy):  # its optimizer is the function's: sharded by owner
            wrapped, _ = DDPStrategy.setup(self._strategy, model, no_optimizer, self._env)
            self.owners.append(ParameterOwners(wrapped, self._env))
        else:
            wrapped, _ = self._strategy.setup(model, no_optimizer, self._env)  # the function builds its own
        _eval_without_collectives(wrapped)
        self.models.append(wrapped)
        return wrapped

    def close(self) -> None:
        for owners in self.owners:
            owners.close()


class ParameterOwners:
    """ZeRO stage 1 for an optimizer the function builds itself. Each parameter has one owner rank
    (the largest first, each to the least loaded rank, as torch's ZeroRedundancyOptimizer
    partitions). Before a step the gradients a rank does not own are dropped, so its optimizer
    skips those parameters and keeps state for its own only; after it each owner broadcasts what
    it updated. The gradients are DDP's averaged ones: every parameter moves as under DDP."""

    def __init__(self, model: nn.Module, env: DistEnv) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.rank = env.rank
        self.params = [p for p in model.parameters() if p.requires_grad]
        loads = [0] * env.world_size
        self.owner: dict[nn.Parameter, int] = {}
        for p in sorted(self.params, key=lambda p: -p.numel()):  # stable: the same on every rank
            self.owner[p] = loads.index(min(loads))
            loads[self.owner[p]] += p.numel()
        self._hooks = [
            register_optimizer_step_pre_hook(self._drop_foreign_gradients),
            register_optimizer_step_post_hook(self._broadcast_updates),
        ]

    def _steps_these(self, optimizer: Any) -> bool:
        return any(p in self.owner for group in optimizer.param_groups for p in group["params"])

    def _drop_foreign_gradients(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._steps_these(optimizer):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if self.owner.get(p, self.rank) != self.rank:
                        p.grad = None

    def _broadcast_updates(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._steps_these(optimizer):
            with torch.no_grad():
                for p in self.params:  # the same order on every rank
                    dist.broadcast(p.data, src=self.owner[p])

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _eval_without_collectives(model: nn.Module) -> None:
    """model.eval() / model.train() switch the model between the training forward (collectives
    wherever the strategy needs them) and an eval forward that needs none, so ranks holding
    different numbers of test samples never wait for each other."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    resharding: dict[int, bool] = {}  # each module's setting when eval() was called, for train()
    original_train = model.train

    def train(self: nn.Module, mode: bool = True) -> nn.Module:
        was_training = self.training
        original_train(mode)
        if mode == was_training:
            return self
        if isinstance(self, DistributedDataParallel):
            self.require_backward_grad_sync = mode  # no_sync's switch: no buffer sync in an eval forward
        for m in sharded:  # gathered once here, together on every rank: eval() is called by all
            if not mode:
                resharding[id(m)] = _reshards_after_forward(m)
                m.set_reshard_after_forward(False, recurse=False)
                m.unshard()
            else:
                m.set_reshard_after_forward(resharding.get(id(m), True), recurse=False)
                m.reshard()
        return self

    model.train = types.MethodType(train, model)  # type: ignore[method-assign]


def _reshards_after_forward(module: nn.Module) -> bool:
    """FSDP2's current reshard_after_forward of the module (the root's changes at its first forward)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    # torch >= 2.12 keeps a list of parameter groups; before, one group (or None)
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    return any(g is not None and g.post_forward_mesh_info is not None for g in groups)


class StepCounter:
    """Optimizer steps this rank took while the function ran (torch's global step hook), and the
    optimizers that took them."""

    def __init__(self) -> None:
        self.steps = 0
        self.optimizers: list[Any] = []
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(self._count)

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)

    def state_bytes(self) -> int:
        """The optimizers' state on this rank (Adam's moments: what ZeRO shards)."""
        return sum(
            t.numel() * t.element_size()
            for o in self.optimizers
            for state in o.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )

    def close(self) -> None:
        self._handle.remove()


def run(run: RunConfig, env: DistEnv, run_dir: Path, payload: Payload | None) -> Finished | None:
    """One rank's trainer=function run; rank 0 returns the summary."""
    seed_everything(run.trainer.seed)  # as a plain run of the function would start (the same seed on every rank)
    fn, build, train_set, test_set, hparams = _inputs(run, payload)
    if len(train_set) < env.world_size:  # type: ignore[arg-type]
        raise UserError(
            f"the training set has {len(train_set)} samples for {env.world_size} ranks: "  # type: ignore[arg-type]
            "give it at least one sample per rank"
        )
    strategy = strategies.build(run.strategy, run.trainer.precision)
    factory = ModuleFactory(build, strategy, env)
    train_shard = Shard(train_set, env.rank, env.world_size, equal=True)
    test_shard = Shard(test_set, env.rank, env.world_size, equal=False) if test_set is not None else None
    if env.is_main:
        print(
            f"dtf: {env.world_size} rank(s), strategy={run.strategy.name}, device={env.device}, your function "
            f"{_name(fn, run)}: {len(train_shard)} training samples per rank; run dir {run_dir}",
            flush=True,
        )
    counter = StepCounter()
    started = time.perf_counter()
    try:
        returned = fn(factory, dict(hparams), train_shard, test_shard)
    finally:
        counter.close()
        factory.close()
    seconds = time.perf_counter() - started
    result = _averaged(returned, len(test_shard) if test_shard is not None else 1, env)
    return _finish(run, env, run_dir, factory, strategy, result, counter, seconds, len(train_set))  # type: ignore[arg-type]


def _inputs(
    run: RunConfig, payload: Payload | None
) -> tuple[Callable[..., Any], Callable[..., nn.Module], Dataset, Dataset | None, Mapping[str, Any]]:
    cfg = run.composed  # the function, model and datasets are the user's, built by _target_
    hparams = {str(k): v for k, v in run.trainer.hparams.items()}
    if payload is not None:
        if payload.module is not None:
            build: Callable[..., nn.Module] = payload.module
        else:
            build = _from_config(cfg.model)
        if payload.train_set is not None:
            train_set, test_set = payload.train_set, payload.test_set
        else:
            train_set, test_set = split_datasets(cfg.data.dataset)
        return payload.fn, build, train_set, test_set, {**hparams, **payload.hparams}
    train_set, test_set = split_datasets(cfg.data.dataset)
    fn: Callable[..., Any] = instantiate(cfg.trainer.fn)
    return fn, _from_config(cfg.model), train_set, test_set, hparams


def _name(fn: Any, run: RunConfig) -> str:
    if run.trainer.fn is not None:
        return str(run.trainer.fn["_target_"])
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _from_config(model_cfg: DictConfig) -> Callable[..., nn.Module]:
    def build(**kwargs: Any) -> nn.Module:
        model: nn.Module = instantiate(model_cfg, **kwargs)
        return model

    return build


def _averaged(returned: Any, count: int, env: DistEnv) -> float | dict[str, float]:
    """The function's value(s), averaged over the ranks with this rank's test samples as weight."""
    if isinstance(returned, Mapping):
        names = sorted(returned)
        values = [returned[k] for k in names]
    else:
        names, values = [], [returned]
    try:
        numbers = [float(v) for v in values]
    except (TypeError, ValueError):
        raise UserError(
            f"trainer.fn returned {returned!r}: return a number (e.g. the test loss) or a dict of numbers"
        ) from None
    sums = torch.tensor([*(v * count for v in numbers), float(count)], dtype=torch.float64)
    shapes = [None] * env.world_size
    dist.all_gather_object(shapes, names)  # every rank must return the same kind of value
    if any(s != names for s in shapes):
        raise UserError(
            f"trainer.fn returned different keys on different ranks ({shapes}): return the same on every rank"
        )
    dist.all_reduce(sums)
    averaged = (sums[:-1] / sums[-1]).tolist()
    return dict(zip(names, averaged, strict=True)) if names else averaged[0]


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
        counter.steps, ",".join(digests), run_summary.peak_rss_bytes(), optimizer_state_bytes=counter.state_bytes()
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
        objective_name=run.trainer.objective if isinstance(result, dict) else "result",
        global_step=ranks[0].steps,
        optimizer_state_bytes=[r.optimizer_state_bytes for r in ranks],
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


def _objective(run: RunConfig, result: float | dict[str, float]) -> float:
    """The value trainer.objective names among the function's returned values (its only one, if one)."""
    if not isinstance(result, dict):
        return result
    objective_name = run.trainer.objective.partition("/")[2]
    if objective_name not in result:
        raise UserError(
            f"trainer.objective={run.trainer.objective}: the function returned {sorted(result)}; name one of "
            f"them, e.g. trainer.objective=test/{sorted(result)[0]}"
        )
    return result[objective_name]
