"""The optimizer as every rank builds it: the user's class and settings, with torch's fused kernel
where the user left the implementation open (neither `fused` nor `foreach` given).

torch defaults to its per-parameter loop on the CPU and to the foreach kernels on a GPU, and keeps
the fused kernels opt-in. For the same update (the same formulas, in one pass over each tensor) the
fused one is the fastest everywhere: Adam's step on the default job's MLP takes 54 us fused
against 175 us in the loop on this 2-core machine, a tenth of the whole step
(benchmarks/overhead.py). On a GPU it is also what lets the non-finite check skip a bad step on
the device instead of waiting for it (dtf.train.nonfinite). `+optimizer.fused=false` (torch's
default implementation) or `+optimizer.foreach=true` choose otherwise. No key is added to the
optimizer's config: a user's own factory (optimizer._target_) receives only what it was given.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import _default_to_fused_or_foreach

from dtf.memory import OptimizerFactory


def fused_where_possible(factory: OptimizerFactory) -> OptimizerFactory:
    """factory, building the fused implementation where its optimizer has one, the user chose
    none, torch runs every parameter through it (its own test: floating point, on a device with
    fused kernels), and every parameter is a plain fp32 or fp64 tensor."""
    if not (isinstance(factory, functools.partial) and isinstance(factory.func, type)):
        return factory
    cls = factory.func
    if not issubclass(cls, Optimizer) or "fused" not in inspect.signature(cls).parameters:
        return factory
    if factory.keywords.get("fused") is not None or factory.keywords.get("foreach") is not None:
        return factory  # the user's choice

    def build(params: Iterable[Any]) -> Optimizer:
        params = list(params)
        tensors = _tensors(params)
        fused, _ = _default_to_fused_or_foreach(tensors, differentiable=False, use_fused=True)
        # Plain fp32/fp64 tensors only: there the fused update is the loop's to rounding. Sharded
        # parameters (DTensors) lack fused kernels for some optimizers (SGD in torch 2.13), and on
        # bf16 parameters the CPU kernel's update differs from the loop's (a bf16 run stalled).
        plain = all(type(t) is torch.Tensor or type(t) is nn.Parameter for t in tensors)
        full = all(t.dtype in (torch.float32, torch.float64) for t in tensors)
        return factory(params, fused=True) if fused and plain and full else factory(params)

    return build


def _tensors(params: list[Any]) -> list[torch.Tensor]:
    """The parameters, given as tensors or as param groups (dicts with "params")."""
    found: list[torch.Tensor] = []
    for p in params:
        if isinstance(p, dict):
            group = p["params"]
            found.extend([group] if isinstance(group, torch.Tensor) else group)
        else:
            found.append(p)
    return found
