"""The one protocol the Trainer talks to, whatever distributes the model."""

from __future__ import annotations

import contextlib
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dtf.dist.env import DistEnv
from dtf.memory import WHOLE_REPLICA, OptimizerFactory, StateShares
from dtf.strategy.optimizer_state import allocate_state

# The low dtype of each mixed trainer.precision: the loop's autocast (dtf.train.precision) and the
# FSDP2 family's MixedPrecisionPolicy compute in it.
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def no_optimizer(params: Iterable[nn.Parameter]) -> Optimizer:
    """An OptimizerFactory for setup() where the optimizer comes from elsewhere (ZeRO-1's sharded
    one, a function's own): the model is wrapped, and the optimizer returned is None."""
    return None  # type: ignore[return-value]


class Strategy(ABC):
    name: str
    # After the gradient reduction every rank holds the same, whole gradients (DDP, ZeRO-1); the
    # FSDP family holds shards.
    replicated_gradients = True

    def __init__(self, cfg: Any, precision: str = "32") -> None:
        self.cfg = cfg  # the strategy's config dataclass (dtf.config.schema)
        self.name = cfg.name  # what the user chose (zero, even when FSDP2 runs it)
        self.precision = precision  # trainer.precision (the FSDP2 family sets its MixedPrecisionPolicy by it)

    @abstractmethod
    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory, env: DistEnv) -> tuple[nn.Module, Optimizer]:
        """Move and wrap the model for this strategy, then build the optimizer over what each rank holds."""

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient synchronisation (the micro-batches of an accumulation window but the last)."""
        return contextlib.nullcontext()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict (unsharded, wrapper prefixes removed), on every rank, in the
        module's own order (what torch.save(model.state_dict()) keeps: loading by position works)."""
        whole = dict(self.whole_tensors(model))
        return {name: whole[name] for name in self.state_names(model)}

    def state_names(self, model: nn.Module) -> list[str]:
        """The model's state dict keys (wrapper prefixes removed), in the module's order."""
        return list(get_model_state_dict(model))

    def whole_tensors(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's state by name, in sorted order, one whole (unsharded) tensor at a time: a
        collective per sharded tensor, in the same order on every rank. What a digest needs,
        without the whole of a sharded model on any rank at once."""
        state = cast(dict[str, torch.Tensor], get_model_state_dict(model))  # sharded ones stay DTensors
        for name in sorted(state):
            tensor = state[name]
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def state_dict(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        """Model and optimizer state keyed by parameter names (sharded tensors stay sharded), the
        form torch.distributed.checkpoint saves and reshards onto any world size or strategy."""
        allocate_state(optimizer)  # where it has none yet: what torch's get_state_dict would step for
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def grad_scaler(self, device: torch.device) -> GradScaler:
        """fp16-mixed's gradient scaler. Here every rank holds the same (averaged) gradients, so each
        decides alike whether they overflowed."""
        return GradScaler(device.type)

    def build_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        """Builds the model where this strategy wants it: on meta with strategy.meta_init (delayed
        initialisation; setup materialises it)."""
        if getattr(self.cfg, "meta_init", False):
            with torch.device("meta"):
                return build()
        return build()

    def state_shares(self, world_size: int) -> StateShares:
        """What share of the model's state a rank holds (dtf.memory estimates from it)."""
        return WHOLE_REPLICA

    def model_state_bytes(self, model: nn.Module, optimizer: Optimizer) -> int:
        """Bytes this rank holds for parameters + gradients + optimizer state."""
        return parameter_and_grad_bytes(model) + local_state_bytes(optimizer)

    def local_state_tensors(self, model: nn.Module, optimizer: Optimizer) -> Iterator[torch.Tensor]:
        """The parameters and optimizer state this rank holds (DTensors as they are)."""
        yield from model.parameters()
        yield from _tensors(list(optimizer.state.values()))


def initialise(module: nn.Module) -> None:
    """Every module's reset_parameters, then any module's load_pretrained_in_place, for a model
    materialised from meta (strategy.meta_init; model=hf's pretrained weights under a sharding strategy).
    Children first, in the order they were registered: the leaves draw their random numbers in the
    order a model's constructor does (so a replica matches one built eagerly, bit for bit), and a
    module that initialises its whole subtree its own way (a transformers model, whose class token
    has no reset_parameters) has the last word, as at construction."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DTensor's RNG tracker notes that CPU meshes use the local RNG
        for m in _children_first(module, set()):
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
    # ... then a module whose weights come from files (model=hf's pretrained ones) loads them over
    # the random ones, into whatever this rank holds (a collective: every rank gets here alike).
    for m in _children_first(module, set()):
        load = getattr(m, "load_pretrained_in_place", None)
        if callable(load):
            load()


def _children_first(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    if id(module) in seen:  # a module registered twice is initialised once
        return
    seen.add(id(module))
    for child in module.children():
        yield from _children_first(child, seen)
    yield module


def materialise_whole(module: nn.Module, device: torch.device) -> nn.Module:
    """A replica built on meta, allocated on the device and initialised. Every rank draws the
    same numbers (the same seed, nothing drawn per rank before), so the replicas start equal."""
    if any(p.is_meta for p in module.parameters()):
        module.to_empty(device=device)
        initialise(module)
    return module


def parameter_and_grad_bytes(model: nn.Module) -> int:
    params = list(model.parameters())
    return sum(_local_bytes(p) for p in params) + sum(_local_bytes(p.grad) for p in params if p.grad is not None)


def local_state_bytes(optimizer: Optimizer) -> int:
    return sum(_local_bytes(t) for t in _tensors(list(optimizer.state.values())))


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank
    return local.numel() * local.element_size()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)
