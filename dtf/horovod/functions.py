"""Horovod's helpers over the collectives: broadcast a model's parameters or an optimizer's
state from one rank, and broadcast or all-gather any picklable object
(horovod/torch/functions.py, with the same semantics)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch

from dtf.horovod.ops import allgather, broadcast_, broadcast_async_, rank, size, synchronize


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Writes root_rank's tensors into every rank's: a state_dict() (a dict, in sorted name
    order), named_parameters() or parameters() (a list)."""
    if isinstance(params, dict):
        pairs = sorted(params.items())
    elif isinstance(params, list):
        pairs = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [broadcast_async_(p, root_rank, name) for name, p in pairs]
    for handle in handles:
        synchronize(handle)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """root_rank's obj (pickled with cloudpickle), on every rank."""
    name = name or type(obj).__name__
    if rank() == root_rank:
        data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        broadcast_(length, root_rank, name + ".sz", process_set)
    else:
        length = broadcast_(torch.zeros(1, dtype=torch.int64), root_rank, name + ".sz", process_set)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, name + ".t", process_set)
    return obj if rank() == root_rank else cloudpickle.loads(data.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's obj, in rank order."""
    name = name or type(obj).__name__
    data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64), name=name + ".sz").tolist()
    gathered = allgather(data, name=name + ".t").numpy().tobytes()
    starts = [sum(sizes[:i]) for i in range(size())]
    return [cloudpickle.loads(gathered[s : s + n]) for s, n in zip(starts, sizes, strict=True)]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """root_rank's optimizer state and settings (the learning rate, ...) on every rank. An
    optimizer that has not stepped yet gets its state made first, by a step with zero gradients
    (as Horovod does)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    sparse: set[int] = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    if not state_dict["state"]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.data.new_zeros(p.size())
                    if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                        p.grad = p.grad.to_sparse()
        # A DistributedOptimizer's own step would all-reduce, which every rank would have to join.
        from dtf.horovod.optimizer import is_distributed

        if is_distributed(optimizer):
            super(type(optimizer), optimizer).step()  # type: ignore[misc]
        else:
            optimizer.step()
        state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        return  # a stateless optimizer (plain SGD)

    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, Any] = {}
    assign: dict[str, Callable[[Any], None]] = {}
    occurrences: collections.Counter[str] = collections.Counter()

    def set_option(index: int, key: str) -> Callable[[Any], None]:
        return lambda v: optimizer.param_groups[index].__setitem__(key, v)

    def set_state(pid: int, key: str) -> Callable[[Any], None]:
        return lambda v: state_dict["state"][pid].__setitem__(key, v)

    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[f"{key}.{index}"] = value
                assign[f"{key}.{index}"] = set_option(index, key)
        for pid in group["params"]:
            for key, value in state_dict["state"].get(pid, {}).items():
                occurrences[key] += 1
                unique = f"{key}.{occurrences[key]}"
                if torch.is_tensor(value):
                    tensors.append((unique, value))
                else:
                    scalars[unique] = value
                    assign[unique] = set_state(pid, key)
    broadcast_parameters(tensors, root_rank)
    for key, value in broadcast_object(scalars, root_rank).items():
        assign[key](value)
