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
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import Dataset

from dtf import strategy as strategies
from dtf.config.typed import typed
from dtf.data.loader import split_datasets
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.results import Finished
from dtf.train import summary as run_summary


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
            wrapped, _ = DDPStrategy.setup(self._strategy, model, _no_optimizer, self._env)
            self.owners.append(ParameterOwners(wrapped, self._env))
        else:
            wrapped, _ = self._strategy.setup(model, _no_optimizer, self._env)
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


def _no_optimizer(params: Any) -> Any:
    return None  # the function builds its own


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
    groups = module._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
    return any(g.post_forward_mesh_info is not None for g in groups)


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


def run(cfg: DictConfig, env: DistEnv, run_dir: Path, payload: Payload | None) -> Finished | None:
    """One rank's trainer=function run; rank 0 returns the summary."""
    r = typed(cfg)
    fn, build, train_set, test_set, hparams = _inputs(cfg, payload)
    if len(train_set) < env.world_size:  # type: ignore[arg-type]
        raise UserError(
            f"the training set has {len(train_set)} samples for {env.world_size} ranks: "  # type: ignore[arg-type]
            "give it at least one sample per rank"
        )
    strategy = strategies.build(r.strategy, r.trainer.precision)
    factory = ModuleFactory(build, strategy, env)
    train_shard = Shard(train_set, env.rank, env.world_size, equal=True)
    test_shard = Shard(test_set, env.rank, env.world_size, equal=False) if test_set is not None else None
    if env.is_main:
        print(
            f"dtf: {env.world_size} rank(s), strategy={r.strategy.name}, device={env.device}, your function "
            f"{_name(fn, cfg)}: {len(train_shard)} training samples per rank; run dir {run_dir}",
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
    return _finish(cfg, env, run_dir, factory, strategy, result, counter, seconds, len(train_set))  # type: ignore[arg-type]


def _inputs(
    cfg: DictConfig, payload: Payload | None
) -> tuple[Callable[..., Any], Callable[..., nn.Module], Dataset, Dataset | None, Mapping[str, Any]]:
    node = cfg.trainer.get("hparams")
    configured = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    assert isinstance(configured, dict)
    hparams = {str(k): v for k, v in configured.items()}
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


def _name(fn: Any, cfg: DictConfig) -> str:
    if cfg.trainer.get("fn") is not None:
        return str(cfg.trainer.fn._target_)
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
    cfg: DictConfig,
    env: DistEnv,
    run_dir: Path,
    factory: ModuleFactory,
    strategy: strategies.Strategy,
    result: float | dict[str, float],
    counter: StepCounter,
    seconds: float,
    num_samples: int,
) -> Finished | None:
    r = typed(cfg)
    states = [strategy.full_state_dict(m) for m in factory.models]  # an all-gather for sharded models
    digests = [run_summary.params_sha256(state) for state in states]
    local = {
        "steps": counter.steps,
        "digest": ",".join(digests),
        "peak_rss": run_summary.peak_rss_bytes(),
        "optimizer_state": counter.state_bytes(),
    }
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, local)
    if not env.is_main:
        return None
    objective_name = r.trainer.objective.partition("/")[2]
    if isinstance(result, dict):
        if objective_name not in result:
            raise UserError(
                f"trainer.objective={r.trainer.objective}: the function returned {sorted(result)}; name one of "
                f"them, e.g. trainer.objective=test/{sorted(result)[0]}"
            )
        objective = result[objective_name]
    else:
        objective = result
    summary: dict[str, Any] = {
        "world_size": env.world_size,
        "mode": "function",
        "result": result,
        "objective": objective,
        "objective_name": r.trainer.objective if isinstance(result, dict) else "result",
        "objective_mode": r.trainer.objective_mode.value,
        "global_step": gathered[0]["steps"],
        "steps_per_rank": [g["steps"] for g in gathered],
        "params_sha256": gathered[0]["digest"] or None,  # of each model the function built, comma-separated
        "params_sha256_consistent": len({g["digest"] for g in gathered}) == 1,
        "peak_rss_bytes": [g["peak_rss"] for g in gathered],
        "optimizer_state_bytes": [g["optimizer_state"] for g in gathered],
        "train_seconds": seconds,
        "strategy": r.strategy.name,
        "strategy_settings": OmegaConf.to_container(cfg.strategy),
        "launcher": r.launcher.name,
        "data_samples": num_samples,
        "data_dropped_per_epoch": num_samples % env.world_size,
        "run_dir": str(run_dir),
    }
    # The model the function built (the last one, if it built several), as the loop exports it.
    exported = r.trainer.export_weights and bool(states)
    if exported:
        torch.save(states[-1], run_dir / run_summary.WEIGHTS_FILE)
    summary["weights_file"] = run_summary.WEIGHTS_FILE if exported else None
    run_summary.write(run_dir, summary)
    print(
        f"dtf: your function returned {result} (averaged over {env.world_size} rank(s)); "
        f"{gathered[0]['steps']} optimizer steps per rank; summary {run_dir / run_summary.SUMMARY_FILE}",
        flush=True,
    )
    return Finished(summary)
