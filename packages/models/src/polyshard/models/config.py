"""A model's settings, ``[model]`` in a config: which family and its sizes and architecture, each field
documented by the line under it and checked for its own range when built. A family's constraints between
its fields are its spec's (:func:`polyshard.models.check_model`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from polyshard.mesh import divisors
from polyshard.models.errors import ConfigError
from polyshard.models.errors import check_at_least as _check_at_least
from polyshard.models.errors import check_choice as _check_choice
from polyshard.models.errors import check_positive as _check_positive

# Llama's architecture on the GPT: RMSNorm, SwiGLU, rotary positions, no biases.
LLAMA: dict[str, Any] = {"norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"hidden": 64, "num_layers": 4, "num_heads": 4, "context_length": 64},
    "small": {"hidden": 256, "num_layers": 6, "num_heads": 8, "context_length": 256},
    "gpt2-124m": {"hidden": 768, "num_layers": 12, "num_heads": 12, "context_length": 1024, "vocab_size": 50257},
    "llama-tiny": {
        **LLAMA, "hidden": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "context_length": 64,
        "mlp_hidden": 176,
    },
    "llama-3.2-1b": {
        **LLAMA, "hidden": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "context_length": 8192,
        "mlp_hidden": 8192, "vocab_size": 128256, "rope_theta": 500000.0, "tie_embeddings": True, "norm_eps": 1e-5,
        "rope_scale_factor": 32.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
        "rope_original_context": 8192,
    },
    "llama-3-8b": {
        **LLAMA, "hidden": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "context_length": 8192,
        "mlp_hidden": 14336, "vocab_size": 128256, "rope_theta": 500000.0, "norm_eps": 1e-5,
    },
    # Qwen3: Llama's architecture with q/k norms and 128-dim heads at every width.
    "qwen3-tiny": {
        **LLAMA, "qk_norm": True, "hidden": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
        "context_length": 64, "mlp_hidden": 176, "norm_eps": 1e-6, "tie_embeddings": True,
    },
    "qwen3-8b": {
        **LLAMA, "qk_norm": True, "hidden": 4096, "num_layers": 36, "num_heads": 32, "num_kv_heads": 8,
        "head_dim": 128, "context_length": 40960, "mlp_hidden": 12288, "vocab_size": 151936, "rope_theta": 1e6,
        "norm_eps": 1e-6,
    },
    # Mixture-of-experts families (model.kind = "moe-gpt"): every block's MLP is routed experts.
    "mixtral-tiny": {
        **LLAMA, "kind": "moe-gpt", "hidden": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
        "context_length": 64, "num_experts": 4, "top_k": 2, "expert_hidden": 96, "rope_theta": 1e6,
    },
    "mixtral-8x7b": {
        **LLAMA, "kind": "moe-gpt", "hidden": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
        "context_length": 32768, "vocab_size": 32000, "num_experts": 8, "top_k": 2, "expert_hidden": 14336,
        "rope_theta": 1e6,
    },
    "qwen3-moe-tiny": {
        **LLAMA, "kind": "moe-gpt", "qk_norm": True, "hidden": 64, "num_layers": 4, "num_heads": 4,
        "num_kv_heads": 2, "context_length": 64, "num_experts": 8, "top_k": 2, "expert_hidden": 32, "norm_eps": 1e-6,
    },
    "qwen3-30b-a3b": {
        **LLAMA, "kind": "moe-gpt", "qk_norm": True, "hidden": 2048, "num_layers": 48, "num_heads": 32,
        "num_kv_heads": 4, "head_dim": 128, "context_length": 40960, "vocab_size": 151936, "num_experts": 128,
        "top_k": 8, "expert_hidden": 768, "rope_theta": 1e6, "norm_eps": 1e-6,
    },
    "qwen2-moe-tiny": {
        **LLAMA, "kind": "moe-gpt", "qkv_bias": True, "hidden": 64, "num_layers": 4, "num_heads": 4,
        "context_length": 64, "num_experts": 8, "top_k": 2, "expert_hidden": 32, "shared_experts": 1,
        "shared_expert_hidden": 128, "shared_expert_gate": True, "router_renormalize": False, "norm_eps": 1e-6,
    },
}  # fmt: skip


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    kind: str = "gpt"
    """gpt (decoder-only language model), moe-gpt (its mixture-of-experts variant) or vit (image classifier)."""
    preset: str | None = None
    """Sets the sizes (and for Llama, Qwen and Mixtral the architecture below, and kind): tiny, small, gpt2-124m,
    llama-tiny, llama-3.2-1b, llama-3-8b, qwen3-tiny, qwen3-8b, mixtral-tiny, mixtral-8x7b, qwen3-moe-tiny,
    qwen3-30b-a3b or qwen2-moe-tiny; keys given here win."""
    vocab_size: int = 256
    """Tokens in the vocabulary; 256 for the byte-level tokenizer."""
    context_length: int = 64
    """Tokens per sequence (gpt) — the packing length."""
    hidden: int = 64
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Query heads per attention layer."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means num_heads."""
    mlp_ratio: int = 4
    """MLP hidden width = mlp_ratio x hidden."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
    dropout: float = 0.0
    """Dropout probability on attention and MLP outputs."""
    norm: str = "layer"
    """layer (LayerNorm, GPT-2) or rms (RMSNorm, Llama)."""
    activation: str = "gelu"
    """The MLP: gelu (GPT-2's tanh GELU) or swiglu (Llama's gated SiLU, three matrices)."""
    positions: str = "learned"
    """learned (a position table, GPT-2) or rope (rotary embeddings on q and k, Llama)."""
    bias: bool = True
    """Biases in the attention and MLP projections (GPT-2 has them, Llama not)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (positions = rope); Llama 3 uses 500000."""
    rope_scale_factor: float = 1.0
    """Llama 3.1's rotary frequency scaling (Hugging Face rope_type "llama3"): frequencies with wavelengths
    above rope_original_context / rope_low_freq_factor are divided by this; 1 means no scaling (Llama 3.2: 32)."""
    rope_low_freq_factor: float = 1.0
    """With rope scaling: wavelengths above rope_original_context / this are scaled fully."""
    rope_high_freq_factor: float = 4.0
    """With rope scaling: wavelengths below rope_original_context / this are kept; those between are blended."""
    rope_original_context: int = 8192
    """With rope scaling: the context length the model was first trained on (Llama 3: 8192)."""
    norm_eps: float = 1e-5
    """Epsilon of every norm (LayerNorm or RMSNorm, blocks and head); Llama 2 uses 1e-6."""
    mlp_hidden: int | None = None
    """MLP width; None means mlp_ratio x hidden (Llama's intermediate_size)."""
    head_dim: int | None = None
    """Dims of each attention head; None means hidden / num_heads (Qwen3 uses 128 at every width)."""
    qkv_bias: bool | None = None
    """Biases on the q, k and v projections; None follows bias (Qwen2 has them, but none on o or the MLP)."""
    qk_norm: bool = False
    """An RMSNorm over each head's q and k, before rotary positions (Qwen3); its weight is per head dim."""
    num_experts: int = 4
    """Experts per MoE layer (moe-gpt)."""
    top_k: int = 2
    """Experts each token is routed to (moe-gpt)."""
    capacity_factor: float | None = None
    """None for dropless routing; otherwise tokens beyond capacity are dropped (moe-gpt)."""
    aux_loss_weight: float = 0.01
    """Weight of the Switch/GShard load-balancing loss, on each data rank's tokens (moe-gpt)."""
    expert_hidden: int | None = None
    """Width of each routed expert's MLP (moe-gpt); None means the MLP width / top_k, about a dense MLP's
    active FLOPs (Hugging Face's moe_intermediate_size; Mixtral's intermediate_size)."""
    router_renormalize: bool = True
    """Rescale each token's top-k router weights to sum to 1 (Mixtral; Hugging Face's norm_topk_prob);
    false keeps their softmax values (Qwen2-MoE, and Qwen3-MoE configured so) (moe-gpt)."""
    shared_experts: int = 0
    """Shared experts (moe-gpt): a dense SwiGLU MLP of width shared_experts x shared_expert_hidden that
    every token passes through beside its routed experts (Qwen2-MoE: 1, DeepSeek-V3: 1); 0 for none."""
    shared_expert_hidden: int | None = None
    """Width of one shared expert; None means the routed experts' width (moe-gpt)."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(x . w), w one learned vector (Qwen2-MoE)."""
    router: str = "softmax"
    """Router scores (moe-gpt): softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3: the chosen experts'
    affinities normalised, with a per-expert bias that only selects, see router_bias_update_rate)."""
    router_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (router = sigmoid; DeepSeek-V3 uses 0.001): after every optimizer step
    each expert's selection bias moves by this toward balance, from the step's load over all tokens; 0 keeps
    the bias as it is."""
    router_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts split into this many equal groups; 1 is off."""
    router_group_topk: int = 1
    """With router_groups > 1: each token chooses among the experts of its best this-many groups (topk_group)."""
    router_scale: float = 1.0
    """Factor on the chosen experts' weights (DeepSeek-V3's routed_scaling_factor, 2.5 there)."""
    seq_aux_loss_weight: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss, per sequence (moe-gpt; DeepSeek-V3 uses 0.0001)."""
    router_z_loss_weight: float = 0.0
    """Weight of the router z-loss (ST-MoE): mean squared logsumexp of the router logits (moe-gpt)."""
    image_size: int = 8
    """Side of the square input image (vit)."""
    patch_size: int = 2
    """Side of a square patch (vit)."""
    channels: int = 1
    """Input channels (vit)."""
    num_classes: int = 10
    """Output classes (vit)."""

    def __post_init__(self) -> None:
        # model.kind and each family's own constraints are the family's to check (models.check_model).
        if self.preset is not None:
            _check_choice("model.preset", self.preset, list(PRESETS))
        sizes = ("vocab_size", "context_length", "hidden", "num_layers", "num_heads", "mlp_ratio", "num_experts")
        for name in (*sizes, "top_k", "image_size", "patch_size", "channels", "num_classes"):
            _check_positive(f"model.{name}", getattr(self, name))
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(
                f"model.capacity_factor={self.capacity_factor} must be > 0 (e.g. 1.25), or unset for dropless"
            )
        self._check_routing()
        for name in ("head_dim", "expert_hidden", "shared_expert_hidden"):
            if getattr(self, name) is not None:
                _check_positive(f"model.{name}", getattr(self, name))
        _check_at_least("model.shared_experts", self.shared_experts, 0)
        if self.shared_expert_gate and not self.shared_experts:
            raise ConfigError("model.shared_expert_gate gates the shared experts: set model.shared_experts >= 1")
        if self.head_dim is None and self.hidden % self.num_heads:
            raise ConfigError(
                f"model.hidden={self.hidden} is not a multiple of model.num_heads={self.num_heads}; "
                f"choose num_heads in {divisors(self.hidden)}"
            )
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads}; "
                f"choose one of {divisors(self.num_heads)}"
            )
        _check_choice("model.norm", self.norm, ("layer", "rms"))
        _check_choice("model.activation", self.activation, ("gelu", "swiglu"))
        _check_choice("model.positions", self.positions, ("learned", "rope"))
        if not self.rope_theta > 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be > 0 (10000, or 500000 for Llama 3)")
        self._check_rope_scaling()
        if not 0.0 < self.norm_eps < 1.0:
            raise ConfigError(f"model.norm_eps={self.norm_eps} must be in (0, 1) (1e-5; Llama 2 uses 1e-6)")
        if self.positions == "rope" and self.attention_head_dim % 2:
            raise ConfigError(
                f"model.positions='rope' rotates pairs of dims: the head dim (model.head_dim, or hidden/num_heads)="
                f"{self.attention_head_dim} must be even"
            )
        if self.mlp_hidden is not None:
            _check_positive("model.mlp_hidden", self.mlp_hidden)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")

    def _check_routing(self) -> None:
        for name in ("aux_loss_weight", "seq_aux_loss_weight", "router_z_loss_weight", "router_bias_update_rate"):
            _check_at_least(f"model.{name}", getattr(self, name), 0.0)
        _check_choice("model.router", self.router, ("softmax", "sigmoid"))
        if self.router_bias_update_rate > 0 and self.router != "sigmoid":
            raise ConfigError(
                f"model.router_bias_update_rate={self.router_bias_update_rate} balances a sigmoid router's selection "
                f"bias, but model.router={self.router!r}; set router='sigmoid' or router_bias_update_rate=0"
            )
        if not 0.0 < self.router_scale < math.inf:
            raise ConfigError(f"model.router_scale={self.router_scale} must be > 0 (1 leaves the weights as they are)")
        _check_positive("model.router_groups", self.router_groups)
        if self.num_experts % self.router_groups:
            raise ConfigError(
                f"model.router_groups={self.router_groups} must divide model.num_experts={self.num_experts}; "
                f"choose router_groups in {divisors(self.num_experts)}"
            )
        if not 1 <= self.router_group_topk <= self.router_groups:
            raise ConfigError(
                f"model.router_group_topk={self.router_group_topk} must be between 1 and model.router_groups="
                f"{self.router_groups}"
            )
        reachable = self.router_group_topk * (self.num_experts // self.router_groups)
        if self.router_groups > 1 and self.top_k > reachable:
            raise ConfigError(
                f"model.top_k={self.top_k} exceeds the {reachable} experts of model.router_group_topk="
                f"{self.router_group_topk} groups of {self.num_experts // self.router_groups}; raise "
                f"router_group_topk or lower top_k"
            )

    def _check_rope_scaling(self) -> None:
        if not 1.0 <= self.rope_scale_factor < math.inf:
            raise ConfigError(
                f"model.rope_scale_factor={self.rope_scale_factor} must be >= 1 (1: no scaling; Llama 3.2 uses 32)"
            )
        if not 0.0 < self.rope_low_freq_factor < self.rope_high_freq_factor < math.inf:
            raise ConfigError(
                f"model.rope_low_freq_factor={self.rope_low_freq_factor} and model.rope_high_freq_factor="
                f"{self.rope_high_freq_factor} need 0 < low < high (Llama 3 uses 1 and 4)"
            )
        _check_positive("model.rope_original_context", self.rope_original_context)
        if self.rope_scale_factor != 1.0 and self.positions != "rope":
            raise ConfigError(
                f"model.rope_scale_factor={self.rope_scale_factor} scales rotary positions, but model.positions="
                f"{self.positions!r}; set positions='rope' or rope_scale_factor=1"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def mlp_width(self) -> int:
        return self.mlp_hidden or self.mlp_ratio * self.hidden

    @property
    def attention_head_dim(self) -> int:
        """Dims per attention head: head_dim, or hidden / num_heads when unset."""
        return self.head_dim or self.hidden // self.num_heads

    @property
    def qkv_biased(self) -> bool:
        """Whether q, k and v have biases: qkv_bias, or bias when unset."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def expert_width(self) -> int:
        """Width of each routed expert (moe-gpt): expert_hidden, or the MLP width / top_k when unset."""
        return self.expert_hidden or max(1, self.mlp_width // self.top_k)

    @property
    def shared_width(self) -> int:
        """Width of the shared experts' one MLP (moe-gpt): shared_experts x one's width; 0 without them."""
        return self.shared_experts * (self.shared_expert_hidden or self.expert_width)
