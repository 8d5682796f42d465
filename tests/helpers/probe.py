"""A model that tells what happened inside it, and data that overflows fp16 gradients: what the
tests of trainer.precision, compile and activation_checkpointing plug in by _target_."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dtf.data.datasets import Splits, scalar_field


class ProbeLinear(nn.Linear):
    """An nn.Linear that counts its forward calls (a recomputation in backward included) and
    records the dtype of its weight as forward sees it (FSDP's gathered parameter, if sharded)."""

    calls: ClassVar[int] = 0
    weight_dtypes: ClassVar[set[torch.dtype]] = set()

    @classmethod
    def reset(cls) -> None:
        cls.calls = 0
        cls.weight_dtypes = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ProbeLinear.calls += 1
        ProbeLinear.weight_dtypes.add(self.weight.dtype)
        return super().forward(x)


class ProbeMLP(nn.Module):
    """The approximator's shape (in -> hidden -> hidden -> out, ReLU) built of ProbeLinears."""

    def __init__(self, in_features: int = 2, hidden: int = 100, out_features: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            ProbeLinear(in_features, hidden),
            nn.ReLU(),
            ProbeLinear(hidden, hidden),
            nn.ReLU(),
            ProbeLinear(hidden, out_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def scalar_field_with_outliers(
    num_points: int = 10000, num_test: int = 2000, outliers: tuple[int, ...] = (), target: float = 1e4
) -> Splits:
    """dtf's scalar field with the targets of the training samples at the given indices set to
    `target`: the loss stays finite in fp32, but its gradient (2 x 1e4 / batch x the fp16 loss
    scale 2^16) overflows fp16 in backward, so fp16-mixed skips the steps of those batches. The
    test split is left clean."""
    train, test = scalar_field(num_points, num_test)
    x, y = train.tensors
    y = y.clone()
    y[list(outliers)] = target
    return TensorDataset(x, y), test
