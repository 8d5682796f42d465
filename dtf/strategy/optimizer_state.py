"""An optimizer's state, allocated for a checkpoint to load into, without stepping the optimizer
on the model's own (possibly sharded) parameters."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


def allocate_state(optimizer: Optimizer) -> None:
    """An optimizer's state, allocated as its first step allocates it, for a checkpoint to load
    into; nothing where it has state already.

    torch's get_state_dict does this by stepping the optimizer itself with zero gradients. On the
    FSDP family's DTensors that step is each operation's first use, and DTensor works out how to
    shard each one (about 0.1 s of CPU a process, paid again at every rank), before the load
    overwrites all it made. Here a twin of the optimizer (its class, its groups' settings, a
    learning rate of 0) steps over plain tensors shaped like this rank's shards, and each state
    tensor shaped like its shard becomes a DTensor laid out like its parameter. Optimizers outside
    torch.optim, and state of any other shape, are left to torch's own step."""
    if optimizer.state or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        return
    groups, pairs = [], []
    for group in optimizer.param_groups:
        twins = []
        for param in group["params"]:
            if not param.requires_grad:
                continue
            local = param.to_local() if isinstance(param, DTensor) else param
            twin = torch.zeros_like(local, requires_grad=True)
            twin.grad = torch.zeros_like(local)
            twins.append(twin)
            pairs.append((param, twin))
        settings = {key: value for key, value in group.items() if key != "params"}
        if "lr" in settings:  # as torch's step sets it
            settings["lr"] = torch.tensor(0.0) if isinstance(settings["lr"], torch.Tensor) else 0.0
        groups.append({**settings, "params": twins})
    if not pairs:
        return
    cls = type(optimizer)
    taken = inspect.signature(cls).parameters  # AdamW's defaults hold a key its constructor does not take
    stepper = cls(groups, **{key: value for key, value in optimizer.defaults.items() if key in taken})
    stepper.step()
    states: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for param, twin in pairs:
        state = {}
        for key, value in stepper.state[twin].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.shape != twin.shape:
                    return  # not a shard's shape: torch's step knows how DTensor lays it out
                if isinstance(param, DTensor):
                    value = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
            state[key] = value
        states.append((param, state))
    for param, state in states:
        optimizer.state[param] = state
