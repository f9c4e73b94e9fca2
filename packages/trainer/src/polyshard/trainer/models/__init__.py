"""Models as plain PyTorch; each exposes ``model.layers``, its ordered pipeline layers."""

from torch import nn

from polyshard.ep import MoEConfig
from polyshard.trainer.config import ModelConfig
from polyshard.trainer.models.gpt import GPT
from polyshard.trainer.models.moe import MoEMLP
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
    if config.kind in ("gpt", "moe-gpt"):
        model = GPT(
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
        if config.kind == "moe-gpt":
            moe = MoEConfig(
                hidden=config.hidden,
                ffn_hidden=config.mlp_ratio * config.hidden // config.top_k,  # about a dense MLP's active FLOPs
                num_experts=config.num_experts,
                top_k=config.top_k,
                capacity_factor=config.capacity_factor,
                aux_loss_coef=config.aux_loss_weight,
            )
            for block in model.layers[1:-1]:
                block.mlp = MoEMLP(moe)
        return model
    raise ValueError(f"unknown model.kind {config.kind!r}")  # ModelConfig already rejects it


__all__ = ["GPT", "ViT", "build_model"]
