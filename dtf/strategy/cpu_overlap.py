"""FSDP2 on CPU, with its collectives beside the compute.

On CUDA, FSDP2 overlaps its all-gathers and reduce-scatters with compute on separate streams. On
CPU its streams are no-ops, so every collective blocks the rank that issues it: the forward waits
for each unit's all-gather, the backward for each unit's reduce-scatter, and across slow links that
is most of the step. gloo runs an async collective in its own threads, so here:
- every unit's all-gather is issued async, and the unit before it issues it (FSDP2's explicit
  forward prefetch; its backward prefetch is implicit) while it computes;
- a unit's reduce-scatter is issued async and waited for at the end of the backward (an autograd
  final callback), before anything reads a gradient. FSDP2 views the sharded gradients out of the
  reduce-scatter's output, so they hold the reduced values once it ends. Not where FSDP2 reads that
  output at once: where the unit's gradients already hold a previous backward's (it adds to them),
  where a hook waits on the gradient, where it divides after the reduction (fp16) or where an
  all-reduce hook follows (MiCS across groups on CPU: dtf.strategy.mics).
The numbers are those of the blocking collectives: the same operations on the same tensors."""

from __future__ import annotations

import itertools
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

# FSDP2 divides after its reduce-scatter only where the reduction's dtype risks overflow.
_DIVIDED_IN_THE_COLLECTIVE = (torch.float32, torch.bfloat16)


def overlap_on_cpu(root: nn.Module, blocks: list[nn.Module], reduce_scatter: bool) -> None:
    """Prefetch the units' all-gathers in forward order (the root, then its blocks as find_blocks
    lists them) and, with reduce_scatter, run their reduce-scatters beside the backward."""
    units = [cast(FSDPModule, root), *(b for b in blocks if isinstance(b, FSDPModule))]
    units[0]._set_unshard_async_op(True)  # FSDP2's own switch: its all-gathers then run in gloo's threads
    for unit, following in itertools.pairwise(units):
        unit.set_modules_to_forward_prefetch([following])
    if reduce_scatter:
        backward = _EndOfBackward()
        for unit in units:
            unit.set_custom_reduce_scatter(_BackgroundReduceScatter(backward, own_parameters(cast(nn.Module, unit))))


def own_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP2 shards as this unit's: its own, less those of the units inside it."""
    inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in inner]


class _EndOfBackward:
    """The reduce-scatters in flight, waited for in an autograd final callback."""

    def __init__(self) -> None:
        self.pending: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []

    def add(self, work: dist.Work, output: torch.Tensor, input: torch.Tensor) -> None:
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self.pending.append((work, output, input))  # the tensors live until gloo is done with them

    def finish(self) -> None:
        for work, _, _ in self.pending:
            work.wait()
        self.pending.clear()


class _BackgroundReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter (set_custom_reduce_scatter), async where nothing reads its output
    before the end of the backward."""

    def __init__(self, backward: _EndOfBackward, unit_parameters: list[nn.Parameter]) -> None:
        self.backward = backward
        self.unit_parameters = unit_parameters

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work:
        read_at_once = input_tensor.dtype not in _DIVIDED_IN_THE_COLLECTIVE or any(
            p.grad is not None or getattr(p, "_post_accumulate_grad_hooks", None) for p in self.unit_parameters
        )
        in_backward = torch._C._current_graph_task_id() != -1  # where a final callback can be queued
        if read_at_once or not in_backward:
            return super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)
        work = super().__call__(output_tensor, input_tensor, group, op, async_op=True)
        assert work is not None
        self.backward.add(work, output_tensor, input_tensor)
        return work  # FSDP2 ignores it; it is waited for at the end of the backward
