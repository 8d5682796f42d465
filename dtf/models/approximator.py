import torch
from torch import nn


class Approximator(nn.Module):
    """The MLP from Maggy's scalar-field example: in -> hidden -> hidden -> out, ReLU."""

    def __init__(self, in_features: int = 2, hidden: int = 100, out_features: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, out_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
