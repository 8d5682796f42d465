"""hvd.SyncBatchNorm: batch normalization over the batch of every rank together
(horovod/torch/sync_batch_norm.py, the same module and semantics), on CPU as well as on GPUs.

Horovod's and torch.nn.SyncBatchNorm use torch's CUDA-only kernels (batch_norm_stats and the
like); here the same arithmetic is written in tensor operations, so that gloo ranks on CPUs run
it too. Forward: the mean over all ranks' samples (the sums all-reduced), then the variance
about it (the squared deviations all-reduced: two passes, as exact as BatchNorm over the global
batch); the running statistics get the unbiased variance of the global batch. Backward: the sums
of dy and dy * (x - mean) are all-reduced, which gives each rank's input its gradient of the sum
of every rank's loss (torch.nn.SyncBatchNorm's rule); weight and bias get this rank's share.
In eval mode (with running statistics) it is plain BatchNorm, as in Horovod.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from dtf.horovod import ops


class SyncBatchNorm(_BatchNorm):
    """num_features: C of an (N, C, ...) input; eps, momentum (None: a cumulative average),
    affine and track_running_stats as in torch.nn.BatchNorm*."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _run_bn(self, input: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training or not self.track_running_stats,
            0.0 if self.momentum is None else self.momentum,
            self.eps,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as torch's BatchNorm
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return self._run_bn(input)
        if ops.size() == 1:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, True, factor, self.eps
            )
        weight = self.weight if self.weight is not None else torch.ones(self.num_features, dtype=input.dtype)
        bias = self.bias if self.bias is not None else torch.zeros(self.num_features, dtype=input.dtype)
        return _SyncBatchNorm.apply(input, weight, bias, self.running_mean, self.running_var, self.eps, factor)


def _per_channel(t: torch.Tensor) -> torch.Tensor:
    """(N, C, ...) -> (C, N x ...): one row of samples per channel."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def _as_input(per_channel: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast over an (N, C, ...) input."""
    return per_channel.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
    ) -> torch.Tensor:
        x = _per_channel(input.detach())
        local = torch.tensor([float(x.shape[1])], dtype=torch.float64)
        count = ops.allreduce(local, op=ops.Sum, name="sync_batch_norm.count").item()
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(count)} over all ranks")
        # the statistics in float64, as torch's CPU kernels accumulate them, then in input's dtype
        x64 = x.double()
        mean64 = ops.allreduce(x64.sum(1), op=ops.Sum, name="sync_batch_norm.sum") / count
        deviations = ops.allreduce(((x64 - mean64[:, None]) ** 2).sum(1), op=ops.Sum, name="sync_batch_norm.sqdev")
        var64 = deviations / count
        mean, invstd = mean64.to(input.dtype), (1.0 / torch.sqrt(var64 + eps)).to(input.dtype)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased = var64 * (count / (count - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.count = count
        xhat = (input - _as_input(mean, input)) * _as_input(invstd, input)
        return xhat * _as_input(weight, input) + _as_input(bias, input)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        input, weight, mean, invstd = ctx.saved_tensors
        dy = _per_channel(grad_output)
        xmu = _per_channel(input) - mean[:, None]
        sum_dy, sum_dy_xmu = dy.sum(1), (dy * xmu).sum(1)
        grad_weight = sum_dy_xmu * invstd if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            both = ops.allreduce(torch.stack([sum_dy, sum_dy_xmu]), op=ops.Sum, name="sync_batch_norm.grad")
            mean_dy, mean_dy_xmu = both[0] / ctx.count, both[1] / ctx.count
            grad_input = (
                grad_output
                - _as_input(mean_dy, input)
                - (input - _as_input(mean, input)) * _as_input(invstd**2 * mean_dy_xmu, input)
            ) * _as_input(invstd * weight, input)
        return grad_input, grad_weight, grad_bias, None, None, None, None
