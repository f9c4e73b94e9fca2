"""The ViT's settings (``[model] kind = "vit"``): an image classifier on square patches."""

from __future__ import annotations

from dataclasses import dataclass

from polyshard.mesh import divisors
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError, check_positive


@dataclass(kw_only=True, frozen=True)
class ViTConfig(ModelConfig):
    kind: str = "vit"
    image_size: int = 8
    """Side of the square input image."""
    patch_size: int = 2
    """Side of a square patch."""
    channels: int = 1
    """Input channels."""
    num_classes: int = 10
    """Output classes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("image_size", "patch_size", "channels", "num_classes"):
            check_positive(f"model.{name}", getattr(self, name))
        if self.hidden % self.num_heads:
            raise ConfigError(
                f"model.hidden={self.hidden} is not a multiple of model.num_heads={self.num_heads}; "
                f"choose num_heads in {divisors(self.hidden)}"
            )


def vit_config(model: ModelConfig) -> ViTConfig:
    """``model`` as the ViT's settings (the spec's functions are declared over every family's)."""
    if not isinstance(model, ViTConfig):
        raise ConfigError(f"model.kind={model.kind!r} is not a ViT; this needs model.kind='vit'")
    return model
