"""A Vision Transformer for small images, exposing its ordered layers for pipelining.

``model.layers`` is ``[PatchEmbedding, Block x depth, ClassifierHead]``:
images (B, C, I, I) -> (B, P + 1, H) -> ... -> logits (B, classes), where
P = (I / patch)^2 patches plus one class token.
"""

from __future__ import annotations

import torch
from torch import nn

from polyshard.mesh import divisors
from polyshard.models.common import Block
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.spec import (
    BuildOptions,
    ModelSpec,
)
from polyshard.models.vit.config import ViTConfig, vit_config
from polyshard.models.vit.plan import check, tp_plan


class PatchEmbedding(nn.Module):
    def __init__(self, image_size: int, patch_size: int, channels: int, hidden: int):
        super().__init__()
        self.patch_size = patch_size
        num_patches = (image_size // patch_size) ** 2
        self.proj = nn.Linear(channels * patch_size * patch_size, hidden)
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos = nn.Parameter(torch.zeros(1, num_patches + 1, hidden))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, _, _ = images.shape
        p = self.patch_size
        # (B, C, I, I) -> (B, I/p, I/p, C*p*p) -> (B, P, C*p*p)
        patches = images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)
        x = self.proj(patches)
        return torch.cat([self.cls.expand(b, -1, -1), x], dim=1) + self.pos


class ClassifierHead(nn.Module):
    def __init__(self, hidden: int, num_classes: int, norm_eps: float = 1e-5):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, eps=norm_eps)
        self.proj = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x[:, 0]))  # type: ignore[no-any-return]  # the class token


class ViT(nn.Module):
    def __init__(
        self,
        *,
        image_size: int,
        patch_size: int,
        channels: int,
        num_classes: int,
        hidden: int,
        num_layers: int,
        num_heads: int,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        checkpoint_activations: bool | str = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        blocks = [
            Block(
                hidden,
                num_heads,
                num_heads,
                mlp_ratio,
                causal=False,
                dropout=dropout,
                checkpoint_activations=checkpoint_activations,
                norm_eps=norm_eps,
            )
            for _ in range(num_layers)
        ]
        self.layers = nn.ModuleList(
            [
                PatchEmbedding(image_size, patch_size, channels, hidden),
                *blocks,
                ClassifierHead(hidden, num_classes, norm_eps),
            ]
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        for layer in self.layers:
            x = layer(x)
        return x


# -- the family's spec ----------------------------------------------------------------------------------


def build(config: ModelConfig, options: BuildOptions) -> ViT:
    config = vit_config(config)
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
        checkpoint_activations=options.checkpoint_activations,
        norm_eps=config.norm_eps,
    )


def sequence_length(model: ModelConfig) -> int:
    """Patches plus the class token."""
    model = vit_config(model)
    return (model.image_size // model.patch_size) ** 2 + 1


def check_model(model: ModelConfig) -> None:
    model = vit_config(model)
    if model.image_size % model.patch_size:
        raise ConfigError(
            f"model.image_size={model.image_size} is not a multiple of model.patch_size={model.patch_size}; "
            f"choose patch_size in {divisors(model.image_size)}"
        )


SPEC = ModelSpec(
    kind="vit",
    config=ViTConfig,
    task="images",
    build=build,
    tp_plan=tp_plan,
    check=check,
    check_model=check_model,
    sequence_length=sequence_length,
    output_width=lambda model: vit_config(model).num_classes,
)
