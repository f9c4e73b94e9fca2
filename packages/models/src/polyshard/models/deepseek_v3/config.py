"""DeepSeek-V3's and V2's settings (``[model] kind = "deepseek-v3"``): the MoE GPT's (Llama-like norms, SwiGLU
and rotary positions; ``[model.moe]``), plus multi-head latent attention's widths, the dense first blocks
and YaRN's rotary scaling (the GPT's rope_* fields, rope_type 'yarn'). ``num_kv_heads``, ``head_dim``,
``qk_norm``, q/k/v biases, sliding windows and sinks are the GPT's attention's and are refused here: MLA has its own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from polyshard.models.common import yarn_mscale
from polyshard.models.common.moe import MoEConfig
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError, check_positive
from polyshard.models.moe_gpt.config import MoEGPTConfig, moe_shape
from polyshard.models.shape import AttentionShape, ModelShape

# GPT attention settings MLA does not read: each must keep its default.
_NOT_MLA = {
    "num_kv_heads": None, "head_dim": None, "qk_norm": False, "qkv_bias": None, "sliding_window": None,
    "layer_types": None, "attention_sinks": False, "tie_embeddings": False,
}  # fmt: skip


@dataclass(kw_only=True, frozen=True)
class DeepSeekV3Config(MoEGPTConfig):
    kind: str = "deepseek-v3"
    norm: str = "rms"
    activation: str = "swiglu"
    positions: str = "rope"
    bias: bool = False
    norm_eps: float = 1e-6
    q_lora_rank: int | None = None
    """Width of the queries' latent (DeepSeek-V3: 1536); None: queries come straight from the hidden state
    (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 32
    """Width of the keys' and values' shared latent (DeepSeek-V2/V3: 512)."""
    qk_nope_head_dim: int = 16
    """Dims of each head's query and key without rotary positions (DeepSeek: 128)."""
    qk_rope_head_dim: int = 8
    """Dims of each head's query and of the one key every head shares that carry rotary positions (DeepSeek: 64)."""
    v_head_dim: int = 16
    """Dims of each head's value (DeepSeek: 128)."""
    attention_bias: bool = False
    """Biases on the down projections and the output projection (Hugging Face's attention_bias)."""
    rope_interleave: bool = True
    """The checkpoints store rotary dims in interleaved pairs (0, 1), (2, 3), ... (DeepSeek's layout)."""
    moe: MoEConfig = field(default_factory=lambda: MoEConfig(dense_layers=[0]))
    """The experts (``[model.moe]``); ``moe.dense_layers`` names the first blocks, which keep a dense SwiGLU
    MLP mlp_hidden wide (Hugging Face's first_k_dense_replace; DeepSeek-V3: [0, 1, 2], V2-Lite: [0])."""
    all_dense_allowed: ClassVar[bool] = True
    rope_type: str = "yarn"
    """DeepSeek stretches its context with YaRN (the GPT's rope_* fields: rope_scale_factor 40 for V3)."""
    rope_original_context: int = 4096
    """With YaRN: the context the model was first trained on (DeepSeek-V2/V3: 4096)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_positive(f"model.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            check_positive("model.q_lora_rank", self.q_lora_rank)
        for name, default in _NOT_MLA.items():
            if getattr(self, name) != default:
                raise ConfigError(
                    f"model.{name}={getattr(self, name)!r} is the GPT's attention's; model.kind='deepseek-v3' uses "
                    f"multi-head latent attention (its own widths) or has none: leave it unset ({default!r})"
                )
        for name, want in (("norm", "rms"), ("activation", "swiglu"), ("positions", "rope")):
            if getattr(self, name) != want:
                raise ConfigError(f"model.{name}={getattr(self, name)!r}: DeepSeek's blocks use {want!r}; set it so")

    def _check_rotary_pairs(self) -> None:
        """Only each head's qk_rope_head_dim dims rotate (the non-rotary ones may be odd); runs from the
        GPT's checks, before this family's own."""
        check_positive("model.qk_rope_head_dim", self.qk_rope_head_dim)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary dims come in pairs)"
            )

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(q/k head dim), times YaRN's mscale(factor, mscale_all_dim) squared when it stretches."""
        scale: float = self.attention_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_mscale_all_dim:
            scale = scale * yarn_mscale(self.rope_scale_factor, self.rope_mscale_all_dim) ** 2
        return scale

    @property
    def attention_head_dim(self) -> int:
        """Dims of each head's query and key: non-rotary and rotary."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def deepseek_config(model: ModelConfig) -> DeepSeekV3Config:
    """``model`` as DeepSeek's settings (the spec's functions are declared over every family's)."""
    if not isinstance(model, DeepSeekV3Config):
        raise ConfigError(f"model.kind={model.kind!r} is not DeepSeek's; this needs model.kind='deepseek-v3'")
    return model


def deepseek_shape(model: ModelConfig) -> ModelShape:
    """The MoE GPT's shape with multi-head latent attention: q/k heads of Dn + Dr dims, values of their own
    width, the latents and the shared rotary key."""
    mla = deepseek_config(model)
    attention = AttentionShape(
        heads=mla.num_heads,
        kv_heads=mla.num_heads,
        qk_head_dim=mla.attention_head_dim,
        v_head_dim=mla.v_head_dim,
        kv_latent=mla.kv_lora_rank,
        q_latent=mla.q_lora_rank or 0,
        shared_key_dim=mla.qk_rope_head_dim,
    )
    return dataclasses.replace(moe_shape(mla), attention=attention)
