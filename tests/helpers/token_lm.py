"""A user's causal LM for data=text before model=hf: a bigram model (embedding, then a linear
head) that takes dict batches {"input_ids", "labels"} and returns the mean token loss with its
token count, as transformers' causal LMs shift their labels.

    model._target_=token_lm.BigramLM ~model.in_features ~model.hidden ~model.out_features +model.vocab_size=256
    trainer.step_fn={_target_: token_lm.token_step, _partial_: true} loss=cross_entropy metrics=perplexity
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Every user override that swaps the default model for this one (the tiny Llama tokenizer has 203 ids).
OVERRIDES = [
    "model._target_=token_lm.BigramLM",
    "~model.in_features",
    "~model.hidden",
    "~model.out_features",
    "+model.vocab_size=256",
    "trainer.step_fn={_target_: token_lm.token_step, _partial_: true}",
    "loss=cross_entropy",
]


class BigramLM(nn.Module):
    def __init__(self, vocab_size: int = 256, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def token_step(model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The mean loss over the batch's label positions, shifted as transformers shifts them, and
    their number (0 for a batch of padding sequences: then the loss is 0, not nan)."""
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    count = int((labels != -100).sum())
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return total / max(count, 1), count
