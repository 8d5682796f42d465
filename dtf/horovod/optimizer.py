"""hvd.DistributedOptimizer: the user's optimizer, with gradients averaged over the ranks before
each step (horovod/torch/optimizer.py, same semantics).

- A hook counts each parameter's backward passes: more than backward_passes_per_step before a
  step raises, as in Horovod; fewer is fine (step() reduces what is there).
- synchronize() reduces the gradients of every parameter the optimizer updates (a missing
  gradient counts as zeros, since another rank may have one) and writes the result into .grad;
  step() synchronizes unless inside skip_synchronize(), then steps.
- The gradients travel in one fused buffer per dtype, in parameter order, as Horovod's tensor
  fusion packs them (its default 64 MB buffer holds any model of this size): one allreduce a
  step, issued at synchronize(), so the order of the backward pass cannot differ between ranks.
- Sparse gradients are reduced dense and made sparse again: the same sum as Horovod's
  sparse_allreduce_async, and a rank without a gradient for the parameter (zeros) still takes
  part in the same allreduce, where an all-gather of indices would need every rank to know the
  gradient is sparse.
- process_set=: the gradients are averaged over its ranks only; a rank outside it steps alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dtf.horovod import ops
from dtf.horovod.compression import Compression, Compressor


class _DistributedOptimizer(torch.optim.Optimizer):
    """Its methods are copied into a subclass of the user's optimizer class (Horovod's way), so
    that the wrapped optimizer is still an instance of that class."""

    def __init__(
        self,
        params: Any,
        named_parameters: Any,
        compression: type[Compressor],
        backward_passes_per_step: int = 1,
        op: int = ops.Average,
        gradient_predivide_factor: float = 1.0,
        sparse_as_dense: bool = False,
        process_set: ops.ProcessSet | None = None,
    ) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]
        self.process_set = ops.global_process_set if process_set is None else process_set
        self._compression = compression
        if named_parameters is not None:
            named = list(named_parameters)
        else:
            named = [
                (f"allreduce.noname.{i}.{j}", v)
                for i, g in enumerate(self.param_groups)
                for j, v in enumerate(g["params"])
            ]
        if any(not isinstance(p, tuple) for p in named):
            raise ValueError(
                "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                "model.named_parameters()."
            )
        names = [k for k, _ in named]
        duplicates = sorted({k for k in names if names.count(k) > 1})
        if duplicates:
            raise ValueError(
                f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}"
            )
        unnamed = {id(v) for g in self.param_groups for v in g["params"]} - {id(v) for _, v in named}
        if unnamed:
            raise ValueError(
                "named_parameters was specified, but one or more model parameters were not named. Python object ids: "
                + ", ".join(str(i) for i in unnamed)
            )
        self._parameter_names = {v: k for k, v in sorted(named, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self._pending: set[torch.Tensor] = set()
        self._requires_update: list[torch.Tensor] = []
        self._hooks: list[Any] = []
        self._synchronized = False
        self._should_synchronize = True
        if self.process_set.included() and ops.size() > 1:  # a rank outside the set steps alone
            self._register_hooks()

    def _register_hooks(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.append(p)
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(*_: Any) -> None:
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally."
                )
            self._allreduce_delay[p] -= 1
            self._pending.add(p)

        return hook

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._pending.clear()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def synchronize(self) -> None:
        """Averages (op) the gradients over the process set's ranks, into each parameter's .grad."""
        if self.process_set.included() and ops.size() > 1:
            self._reduce([p for p in self._requires_update if p.requires_grad])
        self._pending.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = True

    def _reduce(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if p.grad is None:  # another rank may have a gradient for it (a branch it took)
                p.grad = torch.zeros_like(p)
        if self.op == ops.Average:  # split the average around the sum (Horovod's pre/postscale)
            prescale, postscale = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        else:
            prescale = postscale = 1.0
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        for (_, _), members in by_kind.items():
            grads = [g.to_dense() if g.is_sparse else g for g in (p.grad for p in members) if g is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            compressed, ctx = self._compression.compress(flat)
            name = f"DistributedOptimizer.{self._parameter_names.get(members[0])}"
            ops.allreduce_(
                compressed,
                name=name,
                op=self.op,
                prescale_factor=prescale,
                postscale_factor=postscale,
                process_set=self.process_set,
            )
            reduced = self._compression.decompress(compressed, ctx)
            offset = 0
            for p in members:
                part = reduced[offset : offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
                if p.grad.is_sparse:  # type: ignore[union-attr]
                    p.grad = part.to_sparse()
                else:
                    p.grad.copy_(part)  # type: ignore[union-attr]

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """For a step after your own synchronize() (to clip the averaged gradients first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        super(self.__class__, self).zero_grad(set_to_none)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = ops.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
) -> torch.optim.Optimizer:
    """optimizer, with its gradients averaged (op) over the ranks (of process_set) at every
    step(). Its state is not carried over: wrap a new optimizer, or call
    broadcast_optimizer_state after. A rank outside process_set steps on its own gradients."""
    if gradient_predivide_factor != 1.0 and op != ops.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == ops.Adasum:
        raise NotImplementedError("dtf.horovod: op=Adasum is not supported; use hvd.Average")
    # num_groups/groups set how Horovod batches its allreduces; here there is one fused buffer
    # per dtype, so any grouping gives the same result.
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        sparse_as_dense,
        process_set,
    )


def is_distributed(optimizer: torch.optim.Optimizer) -> bool:
    return "_make_hook" in type(optimizer).__dict__
