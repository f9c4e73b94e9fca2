"""A family's block, as numbers: the widths and choices that size its activations, its KV cache and its
FLOPs, declared by the family (its spec's ``shape``) so the planner and the trainer never ask its class.

Shapes: n query heads, k key/value heads, Dqk the q/k dims of a head, Dv a value's. Grouped-query
attention has Dqk = Dv; multi-head latent attention (DeepSeek's MLA) has k = n, Dqk = Dn + Dr, its own
Dv, and keeps a kv latent (and a q latent) whole on every tp rank beside one rotary key of Dr dims that
every head shares.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyshard.models.config import ModelConfig


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    """n, query heads."""
    kv_heads: int
    """k, key/value heads (n without grouped queries)."""
    qk_head_dim: int
    """Dqk, dims of each head's query and key (MLA: non-rotary and rotary)."""
    v_head_dim: int
    """Dv, dims of each head's value (and so of the core's output per head)."""
    qk_norm: bool = False
    """An RMSNorm over each head of q and k (Qwen3)."""
    kv_latent: int = 0
    """MLA: width of the keys' and values' shared latent, which an inference cache keeps; 0 for none."""
    q_latent: int = 0
    """MLA: width of the queries' latent; 0 for none."""
    shared_key_dim: int = 0
    """MLA: dims of the one rotary key all heads share (cached beside the kv latent)."""

    @property
    def q_width(self) -> int:
        return self.heads * self.qk_head_dim

    @property
    def k_width(self) -> int:
        return self.kv_heads * self.qk_head_dim

    @property
    def v_width(self) -> int:
        return self.kv_heads * self.v_head_dim

    @property
    def out_width(self) -> int:
        """The core's output per token: every query head's weighted sum of values."""
        return self.heads * self.v_head_dim

    @property
    def latents(self) -> tuple[int, ...]:
        """MLA's latents (kv, then q), each a matmul output and an RMSNorm's input."""
        return tuple(width for width in (self.kv_latent, self.q_latent) if width)

    @property
    def cache_width(self) -> int:
        """Numbers an inference cache keeps per token and layer: MLA's kv latent and shared rotary key, or
        each key/value head's k and v."""
        if self.kv_latent:
            return self.kv_latent + self.shared_key_dim
        return self.kv_heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def score_width(self) -> int:
        """Multiply-adds per (query, key) pair: each query head's q·k (Dqk) and its share of the weighted
        sum of values (Dv)."""
        return self.heads * (self.qk_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class ExpertShape:
    num_experts: int
    """E, routed experts per MoE block."""
    top_k: int
    """Experts each token is routed to."""
    expert_width: int
    """Hidden units of one routed expert's SwiGLU."""
    shared_width: int
    """Hidden units of the shared experts' one SwiGLU (every token); 0 without them."""


@dataclass(frozen=True)
class ModelShape:
    attention: AttentionShape
    mlp_width: int
    """Hidden units of a dense block's MLP (an MoE model's dense blocks have their own width)."""
    norm: str = "layer"
    """The blocks' norms: "layer" (LayerNorm) or "rms" (RMSNorm)."""
    activation: str = "gelu"
    """A dense MLP's: "gelu" (two matrices) or "swiglu" (gate, up, down)."""
    rotary: bool = False
    """Rotary positions on q and k (else a learned table, or none)."""
    experts: ExpertShape | None = None
    """The MoE blocks' experts; None for a model without them."""
    dense_blocks: frozenset[int] = frozenset()
    """With experts: the blocks (0-based) that keep a dense MLP instead."""

    def sparse(self, block: int) -> bool:
        """Whether block ``block`` (0-based; pipeline layer ``block + 1``) computes with experts."""
        return self.experts is not None and block not in self.dense_blocks


def plain_shape(model: ModelConfig) -> ModelShape:
    """The shape :class:`ModelConfig`'s own fields describe (GPT-2's block: LayerNorm, GELU, learned
    positions, every head with its own key and value), for a family that declares none (the ViT)."""
    head_dim = model.attention_head_dim
    attention = AttentionShape(
        heads=model.num_heads, kv_heads=model.kv_heads, qk_head_dim=head_dim, v_head_dim=head_dim
    )
    return ModelShape(attention=attention, mlp_width=model.mlp_width)
