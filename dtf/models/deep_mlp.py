import torch
from torch import nn


class DeepMLP(nn.Module):
    """in -> width, depth x (width -> width), width -> out, ReLU: a model of equal blocks, so that
    sharded strategies split it evenly (memory and strategy benchmarks use it)."""

    def __init__(self, in_features: int = 2, width: int = 256, depth: int = 8, out_features: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(in_features, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
