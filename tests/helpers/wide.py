"""docs/configuration.md's example of a user's own model: mypkg.nets.Wide, here as wide.Wide."""

import torch
from torch import nn


class Wide(nn.Module):
    def __init__(self, in_features: int = 2, hidden: int = 256, out_features: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)
