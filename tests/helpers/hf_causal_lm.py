"""A transformers causal LM as dtf trains one (as dtf.models.hf.HFModel holds it: the attribute
`hf`, so dtf's names are "hf." + transformers' own), and a data set of token windows from its
tokenizer: the tests' stand-in for model=hf until it lands. Overrides:

    model._target_=tests.helpers.hf_causal_lm.CausalLM ~model.in_features ~model.hidden
    ~model.out_features +model.folder=DIR
    data.dataset._target_=tests.helpers.hf_causal_lm.token_windows ~data.dataset.low
    ~data.dataset.high +data.dataset.folder=DIR loss=cross_entropy metrics=none
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.helpers.hf_models import CORPUS


class CausalLM(nn.Module):
    """AutoModelForCausalLM.from_pretrained(folder) as `hf`; forward(input_ids) -> the logits of
    the token after the last one (what the windows' labels are)."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(folder)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids).logits[:, -1]


def token_windows(
    folder: str, num_points: int = 160, num_test: int = 32, context: int = 8, seed: int = 1234
) -> tuple[TensorDataset, TensorDataset]:
    """Windows of `context` token ids of the corpus (its lines tokenized by the folder's
    tokenizer, in a seeded order, repeated as needed), each labelled with the token after it;
    (train, test) as dtf's built-in data sets."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([i for line in CORPUS for i in tokenizer(line)["input_ids"]])
    starts = torch.randperm(len(ids) - context, generator=torch.Generator().manual_seed(seed))
    starts = starts.repeat(num_points // len(starts) + 1)[:num_points]
    windows = torch.stack([ids[s : s + context + 1] for s in starts.tolist()])
    x, y = windows[:, :-1], windows[:, -1]
    n_train = num_points - num_test
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def overrides(folder: Path) -> list[str]:
    """The overrides that train CausalLM of folder on its token windows."""
    return [
        "model._target_=tests.helpers.hf_causal_lm.CausalLM",
        "~model.in_features",
        "~model.hidden",
        "~model.out_features",
        f"+model.folder={folder}",
        "data.dataset._target_=tests.helpers.hf_causal_lm.token_windows",
        "~data.dataset.low",
        "~data.dataset.high",
        f"+data.dataset.folder={folder}",
        "data.dataset.num_points=160",
        "data.dataset.num_test=32",
        "loss=cross_entropy",
        "metrics=none",
    ]


def write_hf_dir(folder: Path, run_dir: Path) -> Path:
    """<run_dir>/hf/ as dtf.models.hf.write_hf_files writes it at a run's start: the folder's
    files besides the weights (config.json, generation_config.json, the tokenizer's)."""
    hf_dir = run_dir / "hf"
    hf_dir.mkdir(parents=True)
    for path in folder.iterdir():
        if "safetensors" not in path.name:  # the weights and their index
            shutil.copy2(path, hf_dir / path.name)
    return hf_dir
