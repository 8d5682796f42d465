"""A user's own torchmetrics Metric, plugged in by _target_: the number of samples it was shown."""

from __future__ import annotations

import torch
from torchmetrics import Metric


class SampleCount(Metric):
    """How many samples the metric saw, over all ranks (a sum state, as torchmetrics syncs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        self.count += target.shape[0]

    def compute(self) -> torch.Tensor:
        return self.count
