"""Models as plain PyTorch; each exposes ``model.layers``, its ordered pipeline layers."""

from torch import nn

from polyshard.trainer.config import ModelConfig
from polyshard.trainer.models.gpt import GPT
from polyshard.trainer.models.vit import ViT


def build_model(config: ModelConfig) -> nn.Module:
    """The unparallelised model described by ``config`` (seed torch before calling)."""
    if config.kind == "vit":
        return ViT(
            image_size=config.image_size,
            patch_size=config.patch_size,
            channels=config.channels,
            num_classes=config.num_classes,
            hidden=config.hidden,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            mlp_ratio=config.mlp_ratio,
            dropout=config.dropout,
        )
    if config.kind == "gpt":
        return GPT(
            vocab_size=config.vocab_size,
            context_length=config.context_length,
            hidden=config.hidden,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            mlp_ratio=config.mlp_ratio,
            tie_embeddings=config.tie_embeddings,
            dropout=config.dropout,
        )
    raise ValueError(f"unknown model.kind {config.kind!r}")  # ModelConfig already rejects it


__all__ = ["GPT", "ViT", "build_model"]
