"""A Vision Transformer classifier built from a configuration with Hugging Face transformers:
its architecture and initialisation, no weights downloaded (model=vit_tiny, vit_large, vit_huge)."""

from __future__ import annotations

import torch
from torch import nn


class ViT(nn.Module):
    """transformers' ViTForImageClassification from a ViTConfig; forward(images) -> logits.

    Its blocks are transformers' ViTLayer (the children of an nn.ModuleList), which dtf's sharded
    strategies wrap as units and trainer.activation_checkpointing=[ViTLayer] recomputes. Built on
    meta (strategy.meta_init=true) it is initialised where its shards are, by reset_parameters."""

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        num_channels: int = 3,
        num_classes: int = 1000,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(  # type: ignore[call-arg]  # (num_labels: PretrainedConfig's **kwargs)
            image_size=image_size,
            patch_size=patch_size,
            num_channels=num_channels,
            num_labels=num_classes,
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            intermediate_size=intermediate_size,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
        )
        self.vit = ViTForImageClassification(config)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.vit(pixel_values=images).logits

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """transformers' initialisation of every submodule (truncated normal weights, the class token
        and position embeddings too, which have no reset_parameters of their own). Strategies that
        materialise a model built on meta call each module's reset_parameters innermost first, so
        this one, the outermost, has the last word, as at construction."""
        for module in self.vit.modules():
            self.vit._init_weights(module)
