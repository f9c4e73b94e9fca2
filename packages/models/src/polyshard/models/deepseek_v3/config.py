"""DeepSeek-V3's and V2's settings (``[model] kind = "deepseek-v3"``): a decoder with multi-head latent
attention and experts (``[model.moe]``), with DeepSeek's defaults: RMSNorm, SwiGLU, rotary positions with
YaRN's scaling over 4096 positions (``[model.rope]``), a dense first block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from polyshard.models.common.moe import MoEConfig
from polyshard.models.common.rotary import RopeConfig
from polyshard.models.decoder import Experts, LatentAttention
from polyshard.models.errors import ConfigError


def deepseek_rope() -> RopeConfig:
    """DeepSeek stretches its context with YaRN over 4096 positions (the factor, 40 for V3, comes with the sizes)."""
    return RopeConfig(scaling="yarn", original_context=4096)


@dataclass(kw_only=True, frozen=True)
class DeepSeekV3Config(Experts, LatentAttention):
    kind: str = "deepseek-v3"
    norm: str = "rms"
    activation: str = "swiglu"
    positions: str = "rope"
    bias: bool = False
    norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=deepseek_rope)
    moe: MoEConfig = field(default_factory=lambda: MoEConfig(dense_layers=[0]))
    """The experts (``[model.moe]``); ``moe.dense_layers`` names the first blocks, which keep a dense SwiGLU
    MLP mlp_hidden wide (Hugging Face's first_k_dense_replace; DeepSeek-V3: [0, 1, 2], V2-Lite: [0])."""
    all_dense_allowed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, want in (("norm", "rms"), ("activation", "swiglu"), ("positions", "rope")):
            if getattr(self, name) != want:
                raise ConfigError(f"model.{name}={getattr(self, name)!r}: DeepSeek's blocks use {want!r}; set it so")
