"""What every family's settings share: ``[model]`` in a config names the family (``kind``) and then holds
only that family's fields (its own frozen dataclass, a subclass of :class:`ModelConfig`, in its folder's
``config.py``). Each field is documented by the line under it and checked for its own range when built;
a family's constraints between its fields are its spec's (:func:`polyshard.models.check_model`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from polyshard.models.errors import ConfigError
from polyshard.models.errors import check_positive as _check_positive

FROZEN_DTYPES = (None, "bfloat16", "float16")
"""model.frozen_dtype's choices: torch dtype names (None keeps the base in float32)."""


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    kind: str = "gpt"
    """The family: gpt (decoder-only language model: GPT-2, Llama, Qwen2, Qwen3), moe-gpt (its
    mixture-of-experts variant: Mixtral, Qwen-MoE, DeepSeek-style routing), gpt-oss (OpenAI's MoE: sinks,
    alternating windows, YaRN, biased router and clamped-SwiGLU experts) or vit (image classifier)."""
    preset: str | None = None
    """Sets the family's sizes (and architecture) from a named preset; keys given here win."""
    hidden: int = 64
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Query heads per attention layer."""
    mlp_ratio: int = 4
    """MLP hidden width = mlp_ratio x hidden."""
    dropout: float = 0.0
    """Dropout probability on attention and MLP outputs."""
    norm_eps: float = 1e-5
    """Epsilon of every norm (LayerNorm or RMSNorm, blocks and head); Llama 2 uses 1e-6."""
    frozen_dtype: str | None = None
    """With [lora]: keep the frozen base's matrices (linears, embeddings, experts) in "bfloat16" or
    "float16", half their bytes; they compute in it and the adapters add their float32 update. None:
    float32."""

    def __post_init__(self) -> None:
        for name in ("hidden", "num_layers", "num_heads", "mlp_ratio"):
            _check_positive(f"model.{name}", getattr(self, name))
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.frozen_dtype not in FROZEN_DTYPES:
            raise ConfigError(
                f"model.frozen_dtype={self.frozen_dtype!r} must be one of {list(FROZEN_DTYPES)[1:]}, or unset (float32)"
            )
        if not 0.0 < self.norm_eps < 1.0:
            raise ConfigError(f"model.norm_eps={self.norm_eps} must be in (0, 1) (1e-5; Llama 2 uses 1e-6)")

    @classmethod
    def field_names(cls) -> list[str]:
        """The keys ``[model]`` may hold for this family (nested tables by their own name)."""
        return [f.name for f in dataclasses.fields(cls)]

    @property
    def init_rule(self) -> str:
        """The initialisation rule (:mod:`polyshard.models.common.initialise`): GPT-2's unless the family's
        config chooses another."""
        return "gpt2"

    @property
    def kv_heads(self) -> int:
        """Key/value heads of each attention layer (all of them unless a family groups queries)."""
        return self.num_heads

    @property
    def mlp_width(self) -> int:
        """Width of each block's MLP."""
        return self.mlp_ratio * self.hidden

    @property
    def attention_head_dim(self) -> int:
        """Dims per attention head."""
        return self.hidden // self.num_heads

    @property
    def prediction_depth(self) -> int:
        """Multi-token prediction's extra depths, each with its own loss (0: none; the GPT's model.mtp_depth)."""
        return 0
