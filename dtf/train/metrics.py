"""Exact cross-rank averages: all-reduce (sum of value x count, count), never a mean of means."""

from __future__ import annotations

import torch
import torch.distributed as dist


class MeanMetric:
    def __init__(self, device: torch.device) -> None:
        # float64 so that summing many float32 losses loses nothing that matters.
        self._state = torch.zeros(2, dtype=torch.float64, device=device)

    def reset(self) -> None:
        self._state.zero_()

    def update(self, mean_value: torch.Tensor, count: int) -> None:
        """Add a batch whose mean is mean_value over count samples (stays on device: no sync)."""
        self._state[0] += mean_value.detach().to(torch.float64) * count
        self._state[1] += count

    def local(self) -> float:
        total, count = self._state.tolist()
        return total / count if count else float("nan")

    def compute(self) -> float:
        """The mean over every sample seen by every rank (a collective: call on all ranks)."""
        state = self._state.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(state, op=dist.ReduceOp.SUM)
        total, count = state.tolist()
        return total / count if count else float("nan")
