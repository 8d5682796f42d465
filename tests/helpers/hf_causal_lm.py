"""model=hf trained on token-id dicts from the model's own tokenizer (tests/helpers/token_data.py's
causal_lm, as data=text gives them), for the export's tests."""

from __future__ import annotations

from pathlib import Path


def overrides(folder: Path, num_train: int = 32, num_test: int = 8) -> list[str]:
    """model=hf of folder, trained with its own loss (dtf.models.hf.hf_step) on num_train token
    dicts of 4 tokens each, none padded: every rank's batch then counts the same tokens, so that
    runs on 2 ranks and on 1 take the same gradient (ranks' gradients are averaged with equal
    weights, whatever tokens each counted)."""
    return [
        "model=hf",
        f"model.name_or_path={folder}",
        "data=digits",
        "~data.dataset.image_size",
        "~data.dataset.test_fraction",
        "~data.dataset.seed",
        "data.dataset._target_=tests.helpers.token_data.causal_lm",
        f"+data.dataset.folder={folder}",
        f"+data.dataset.num_train={num_train}",
        f"+data.dataset.num_test={num_test}",
        "+data.dataset.length=4",
        "metrics=none",
    ]
