"""The model a training function builds (trainer=function, dtf.run_function), and the optimizers
it builds over it: `module(**kwargs)` builds the model and wraps it by the configured strategy;
with strategy=zero stage 1 the function's own optimizers step element-wise slices of it
(dtf.strategy.zero1, as the Trainer's do); every optimizer step is counted, and the model state
each rank holds is measured after the first.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from dtf import strategy as strategies
from dtf.dist.compat import fsdp_param_groups
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.strategy.base import local_state_bytes, materialise_whole, no_optimizer, parameter_and_grad_bytes
from dtf.strategy.ddp import DDPStrategy
from dtf.strategy.zero1 import FlatLayout, ShardedOptimizer, Zero1Strategy, check_element_wise


class ShardedSteps:
    """ZeRO stage 1 for the optimizers a function builds itself. module() lays the model's
    parameters out as zero1.FlatLayout before DDP wraps it. At an optimizer's first step over
    them, a zero1.ShardedOptimizer is made from it, sharing its param groups (so the function's
    LR schedulers act on it); before each of the optimizer's steps (a global pre-step hook), that
    steps this rank's slice with DDP's averaged gradients and all-gathers the parameters; the
    function's optimizer then finds no gradients and changes nothing, and the gradients are put
    back after its step, where a plain step leaves them. Every parameter moves as under DDP, and
    each rank keeps 1/N of the optimizer state."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.layouts: list[tuple[FlatLayout, dict[nn.Parameter, str]]] = []
        self.sharded: dict[int, ShardedOptimizer] = {}  # by the function's optimizer's id
        self._internal: set[int] = set()  # the ShardedOptimizers and their local optimizers
        self._stashed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._hooks = [register_optimizer_step_pre_hook(self._before), register_optimizer_step_post_hook(self._after)]

    def lay_out(self, model: nn.Module) -> None:
        names = {p: n for n, p in model.named_parameters()}
        self.layouts.append((FlatLayout(list(names), names, self.env.rank, self.env.world_size), names))

    def is_internal(self, optimizer: Any) -> bool:
        return id(optimizer) in self._internal

    def _sharded_for(self, optimizer: Optimizer) -> ShardedOptimizer | None:
        if id(optimizer) in self.sharded:
            return self.sharded[id(optimizer)]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for layout, names in self.layouts:
            if params and all(p in names for p in params):
                check_element_wise(type(optimizer))
                sharded = ShardedOptimizer(optimizer, names, layout=layout)
                sharded.param_groups = optimizer.param_groups  # the function's groups: its LR, its schedulers
                optimizer.state.clear()  # state made up front (Adagrad's) would be the whole model's
                self._internal.update({id(sharded), id(sharded.local)})
                self.sharded[id(optimizer)] = sharded
                return sharded
        if any(p in names for p in params for _, names in self.layouts):
            raise UserError(
                "strategy=zero (stage 1): your function's optimizer holds parameters of several models that module() "
                "built (or tensors that are not parameters): build one optimizer per model"
            )
        return None  # an optimizer over something else

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.is_internal(optimizer):
            return
        sharded = self._sharded_for(optimizer)
        if sharded is None:
            return
        sharded.step()
        self._stashed = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]]
        for p, _ in self._stashed:
            p.grad = None

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.is_internal(optimizer) and self._stashed:
            for p, grad in self._stashed:
                p.grad = grad
            self._stashed = []

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


class ModuleFactory:
    """`module(**kwargs)` inside the function: the model, built and wrapped by the strategy."""

    def __init__(self, build: Callable[..., nn.Module], strategy: strategies.Strategy, env: DistEnv) -> None:
        self._build, self._strategy, self._env = build, strategy, env
        self.models: list[nn.Module] = []
        self.sharded_steps = ShardedSteps(env) if isinstance(strategy, Zero1Strategy) else None

    def __call__(self, **kwargs: Any) -> nn.Module:
        model = self._strategy.build_model(lambda: self._build(**kwargs))
        if self.sharded_steps is not None and isinstance(self._strategy, Zero1Strategy):
            # its optimizer is the function's: the parameters are laid out now, sharded at its first step
            model = materialise_whole(model, self._env.device).to(self._env.device)
            self.sharded_steps.lay_out(model)
            wrapped, _ = DDPStrategy.setup(self._strategy, model, no_optimizer, self._env)
        else:
            wrapped, _ = self._strategy.setup(model, no_optimizer, self._env)  # the function builds its own
        _eval_without_collectives(wrapped)
        self.models.append(wrapped)
        return wrapped

    def close(self) -> None:
        if self.sharded_steps is not None:
            self.sharded_steps.close()


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
    return any(g.post_forward_mesh_info is not None for g in fsdp_param_groups(module))


class StepCounter:
    """The optimizer steps this rank took while the function ran (torch's global step hook), the
    optimizers that took them, and the model state this rank held after the first step (of the
    models factory built; none without a factory)."""

    def __init__(self, factory: ModuleFactory | None = None) -> None:
        self.steps = 0
        self.optimizers: list[Any] = []
        self.model_state_bytes: int | None = None
        self._factory = factory
        self._handle = register_optimizer_step_post_hook(self._count)

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        sharded = self._factory.sharded_steps if self._factory is not None else None
        if sharded is not None and sharded.is_internal(optimizer):
            return
        self.steps += 1
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        if self.model_state_bytes is None and self._factory is not None:  # as the Trainer measures it: after a step
            models = sum(parameter_and_grad_bytes(m) for m in self._factory.models)
            padding = sum(layout.padding_bytes for layout, _ in (sharded.layouts if sharded else []))
            self.model_state_bytes = models + padding + self.state_bytes()

    def _stepping(self, optimizer: Any) -> Any:
        """What holds the state of a function's optimizer: its ShardedOptimizer's local one under ZeRO-1."""
        sharded = self._factory.sharded_steps if self._factory is not None else None
        if sharded is not None and id(optimizer) in sharded.sharded:
            return sharded.sharded[id(optimizer)].local
        return optimizer

    def state_bytes(self) -> int:
        """The optimizers' state on this rank (Adam's moments: what ZeRO shards)."""
        return sum(local_state_bytes(self._stepping(o)) for o in self.optimizers)

    def close(self) -> None:
        self._handle.remove()
