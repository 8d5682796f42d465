"""model=vit_*: transformers' ViT from a config, and its delayed (meta) initialisation."""

from __future__ import annotations

from importlib.resources import files

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dtf.models.vit import ViT
from dtf.strategy.base import initialise

TINY = dict(image_size=28, patch_size=7, num_channels=1, num_classes=10, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=128)  # fmt: skip


def test_the_configs_build_the_sizes_they_name() -> None:
    for name, millions in (("vit_large", 304.3), ("vit_huge", 632.0)):
        cfg = OmegaConf.create((files("dtf.conf") / "model" / f"{name}.yaml").read_text())
        with torch.device("meta"):
            model = instantiate(cfg)
        assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == millions


def test_delayed_init_initialises_every_parameter_as_transformers_does() -> None:
    torch.manual_seed(0)
    eager = ViT(**TINY)
    with torch.device("meta"):
        delayed = ViT(**TINY)
    delayed.to_empty(device="cpu")
    initialise(delayed)
    for (name, e), (_, d) in zip(eager.named_parameters(), delayed.named_parameters(), strict=True):
        assert torch.isfinite(d).all(), name
        if e.numel() > 1 and e.std() > 0:  # the same distribution: transformers' truncated normal (0.02)
            assert abs(d.std().item() - e.std().item()) < 0.2 * e.std().item(), (name, d.std(), e.std())
        else:  # biases 0, LayerNorm weights 1
            assert torch.equal(d, e), name
    # the class token and position embeddings, which have no reset_parameters, are not left empty
    embeddings = delayed.vit.vit.embeddings
    assert 0.01 < embeddings.cls_token.std() < 0.03 and 0.01 < embeddings.position_embeddings.std() < 0.03
    assert delayed(torch.randn(3, 1, 28, 28)).shape == (3, 10)
