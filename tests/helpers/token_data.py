"""Small token-id data sets for model=hf tests, from a saved model's own tokenizer (tests/helpers/
hf_models.py). Each builder is a data.dataset _target_: it returns (train, test).

causal_lm: dict samples {"input_ids", "attention_mask", "labels"} of one padded length, labels equal
to the input ids and -100 on the padding (transformers shifts them inside the model), as data=text
gives them. Lines of different lengths, so batches hold different numbers of tokens.
classes: (token ids, class) pairs of one length, no padding, for sequence classification."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from tests.helpers.hf_models import CORPUS

IGNORE = -100


class TokenDicts(Dataset):
    """Dict samples of equal-length tensors (default_collate stacks them into a dict batch)."""

    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: column[index] for name, column in self.columns.items()}


def lines(num_samples: int) -> list[str]:
    """num_samples lines of text: the corpus's sentences, cut short in every other run of 4 (so
    batches of 4 in order hold very different numbers of tokens)."""
    out = []
    for i in range(num_samples):
        words = CORPUS[i % len(CORPUS)].split()
        out.append(" ".join(words[: 2 + i % 3 + (i // 4 % 2) * 10]))
    return out


def causal_lm_columns(folder: str, num_samples: int, length: int) -> dict[str, torch.Tensor]:
    """The columns of causal_lm's samples: padded on the right with the tokenizer's pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    enc = tokenizer(lines(num_samples), padding="max_length", truncation=True, max_length=length, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, IGNORE)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def causal_lm(folder: str, num_train: int = 16, num_test: int = 8, length: int = 16) -> tuple[Any, Any]:
    cols = causal_lm_columns(folder, num_train + num_test, length)
    train = {k: v[:num_train] for k, v in cols.items()}
    test = {k: v[num_train:] for k, v in cols.items()}
    return TokenDicts(train), TokenDicts(test)


def class_columns(folder: str, num_samples: int, length: int, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [N, length], class [N]): windows of the tokenised corpus, classes in turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    stream: list[int] = []
    while len(stream) < num_samples * length:
        stream += tokenizer(" ".join(CORPUS))["input_ids"]
    ids = torch.tensor(stream[: num_samples * length]).reshape(num_samples, length)
    return ids, torch.arange(num_samples) % num_classes


def classes(
    folder: str, num_train: int = 16, num_test: int = 8, length: int = 12, num_classes: int = 3
) -> tuple[Any, Any]:
    ids, labels = class_columns(folder, num_train + num_test, length, num_classes)
    return TensorDataset(ids[:num_train], labels[:num_train]), TensorDataset(ids[num_train:], labels[num_train:])
