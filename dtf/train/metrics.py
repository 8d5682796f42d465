"""Exact cross-rank averages: all-reduce (sum of value x count, count), never a mean of means."""

from __future__ import annotations

import torch
import torch.distributed as dist


class MeanMetric:
    def __init__(self, device: torch.device) -> None:
        # float64 so that summing many float32 losses loses nothing that matters.
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0

    def reset(self) -> None:
        self.total.zero_()
        self.count = 0

    def update(self, mean_value: torch.Tensor, count: int) -> None:
        """Add a batch whose mean is mean_value over count samples: one in-place op on the device,
        no synchronisation (this runs every step)."""
        self.total.add_(mean_value.detach(), alpha=count)
        self.count += count

    def state_dict(self) -> dict[str, float | int]:
        """The sums over every rank (a collective: call on all ranks)."""
        total, count = self.global_sums()
        return {"sum": total, "count": count}

    def load_state_dict(self, state: dict[str, float | int], holder: bool) -> None:
        """Sums saved over all ranks go to one rank (holder), so that adding up the ranks counts them once."""
        self.total.fill_(float(state["sum"]) if holder else 0.0)
        self.count = int(state["count"]) if holder else 0

    def local(self) -> float:
        return self.total.item() / self.count if self.count else float("nan")

    def global_sums(self) -> tuple[float, int]:
        """(sum, count) over every rank (a collective: call on all ranks)."""
        state = torch.stack(
            [self.total, torch.tensor(float(self.count), dtype=torch.float64, device=self.total.device)]
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(state, op=dist.ReduceOp.SUM)
        total, count = state.tolist()
        return total, int(count)

    def compute(self) -> float:
        """The mean over every sample seen by every rank (a collective: call on all ranks)."""
        total, count = self.global_sums()
        return total / count if count else float("nan")
