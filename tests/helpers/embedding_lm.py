"""A model whose parameters sit mostly in one embedding, as in real language models (GPT-2
small keeps ~30% of its parameters in the token embedding; this toy keeps ~79%), with a data
set it learns and the optimizer recipe language models use (weight decay on matrices only).

    model._target_=embedding_lm.TinyGPT ~model.in_features ~model.hidden ~model.out_features
    data.dataset._target_=embedding_lm.successor_tokens ~data.dataset.low ~data.dataset.high
    loss=cross_entropy metrics=none
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Block(nn.Module):
    """GPT-2's pre-norm transformer block."""

    def __init__(self, width: int, num_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, num_heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """GPT-2's shape at toy size: token and position embeddings, transformer blocks, a final
    norm and an LM head tied to the token embedding. Predicts the token after the context."""

    def __init__(
        self, vocab_size: int = 1024, context: int = 8, width: int = 32, num_heads: int = 2, depth: int = 1
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, num_heads, mlp_ratio=2) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2's initialisation
        nn.init.normal_(self.wpe.weight, std=0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, -1]))


def successor_tokens(
    num_points: int = 2048, num_test: int = 256, vocab_size: int = 1024, context: int = 8, seed: int = 1234
) -> tuple[TensorDataset, TensorDataset]:
    """Runs of consecutive token ids (mod vocab_size) from seeded random starts; the label is
    the next one. (train, test) like dtf's built-in data sets."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab_size, (num_points, 1), generator=g)
    tokens = (starts + torch.arange(context + 1)) % vocab_size
    x, y = tokens[:, :-1], tokens[:, -1]
    n_train = num_points - num_test
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def decay_matrices_only(
    params: Iterable[nn.Parameter],
    lr: float,
    weight_decay: float = 0.1,
    momentum: float = 0.0,
    no_decay_lr_factor: float = 1.0,
) -> torch.optim.SGD:
    """nanoGPT's recipe, with SGD: weight decay on matrices and embeddings, none on biases and
    norms; those get their own LR too (lr * no_decay_lr_factor). A user's optimizer factory
    with two parameter groups: optimizer._target_=embedding_lm.decay_matrices_only."""
    params = list(params)
    return torch.optim.SGD(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": lr * no_decay_lr_factor},
        ],
        lr=lr,
        momentum=momentum,
    )
