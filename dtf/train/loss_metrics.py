"""Metrics made from the loss itself rather than from (output, target) pairs: the step function's
loss and its count (tokens, for a causal LM), whatever step function computed them.

    metrics=perplexity    (conf/metrics/perplexity.yaml)
"""

from __future__ import annotations

import torch
from torchmetrics import Metric


class Perplexity(Metric):
    """exp of the mean loss over every counted item (token) of every rank: the loss's sums (value x
    count, count) summed over the ranks, as dtf's own loss is, then exp; not a mean of per-batch
    perplexities. It is exp(<split>/loss) where the loss is a mean token cross-entropy."""

    takes_loss = True  # dtf.train.metrics.Metrics feeds it (mean loss, count) pairs, not outputs
    full_state_update = False
    higher_is_better = False
    total: torch.Tensor  # states (add_state): summed over the ranks
    count: torch.Tensor

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, mean_loss: torch.Tensor, count: int) -> None:
        self.total += mean_loss.detach().to(torch.float64) * count
        self.count += count

    def compute(self) -> torch.Tensor:
        return torch.exp(self.total / self.count)
