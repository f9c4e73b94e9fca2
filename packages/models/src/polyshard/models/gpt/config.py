"""The GPT family's settings (``[model] kind = "gpt"``): GPT-2's and Llama's architectures (Qwen2's and
Qwen3's too) on one decoder-only transformer."""

from __future__ import annotations

from dataclasses import dataclass

from polyshard.mesh import divisors
from polyshard.models.common import RopeScaling
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError, check_choice, check_positive
from polyshard.models.shape import AttentionShape, ModelShape

INIT_RULES = ("gpt2", "depth")


@dataclass(kw_only=True, frozen=True)
class GPTConfig(ModelConfig):
    vocab_size: int = 256
    """Tokens in the vocabulary; 256 for the byte-level tokenizer."""
    context_length: int = 64
    """Tokens per sequence — the packing length."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means num_heads."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
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
    """Rotary frequency scaling's factor (rope_type says which rule): the context it stretches to over
    rope_original_context; 1 means no scaling (Llama 3.2: 32, gpt-oss: 32)."""
    rope_type: str = "llama3"
    """The scaling rule when rope_scale_factor > 1 (Hugging Face's rope_type): llama3 (Llama 3.1: frequencies
    with wavelengths above rope_original_context / rope_low_freq_factor divided by the factor) or yarn (YaRN,
    gpt-oss and DeepSeek-V3: rope_beta_fast/slow, rope_truncate, rope_mscale*, rope_attention_factor)."""
    rope_beta_fast: float = 32.0
    """YaRN: dims turning more than this many times over rope_original_context keep their frequency."""
    rope_beta_slow: float = 1.0
    """YaRN: dims turning fewer than this many times are divided by the factor (a ramp between)."""
    rope_truncate: bool = True
    """YaRN: round the ramp's ends outward to whole dims (Hugging Face's truncate; gpt-oss: false)."""
    rope_mscale: float | None = None
    """YaRN (DeepSeek): with rope_mscale_all_dim, the attention scale is mscale(f, this) / mscale(f, that)."""
    rope_mscale_all_dim: float | None = None
    """YaRN (DeepSeek): see rope_mscale."""
    rope_attention_factor: float | None = None
    """YaRN: the factor on cos and sin when set; unset: from rope_mscale*, else 0.1 ln(factor) + 1."""
    rope_low_freq_factor: float = 1.0
    """With rope scaling: wavelengths above rope_original_context / this are scaled fully."""
    rope_high_freq_factor: float = 4.0
    """With rope scaling: wavelengths below rope_original_context / this are kept; those between are blended."""
    rope_original_context: int = 8192
    """With rope scaling: the context length the model was first trained on (Llama 3: 8192)."""
    mlp_hidden: int | None = None
    """MLP width; None means mlp_ratio x hidden (Llama's intermediate_size)."""
    head_dim: int | None = None
    """Dims of each attention head; None means hidden / num_heads (Qwen3 uses 128 at every width)."""
    qkv_bias: bool | None = None
    """Biases on the q, k and v projections; None follows bias (Qwen2 has them, but none on o or the MLP)."""
    qk_norm: bool = False
    """An RMSNorm over each head's q and k, before rotary positions (Qwen3); its weight is per head dim."""
    init: str | None = None
    """The initial weights: 'gpt2' (N(0, 0.02), output projections / sqrt(2 x layers)) or 'depth'
    (torchtitan's and Megatron's for Llama: embedding N(0, 1), each block's output projections
    0.02 / sqrt(2 x its depth), the head hidden^-0.5; truncated normals). None: 'depth' for RMSNorm
    (Llama-like) models, 'gpt2' for the others."""
    attention_core: str = "auto"
    """The attention core: auto (plain causal SDPA when nothing is masked; with document masks, sliding windows
    or sinks FlexAttention on CUDA, else blocksparse), sdpa, blocksparse (online softmax over key/value blocks,
    skipping the hidden ones; any device) or flex (FlexAttention, CUDA). Context parallelism runs its own."""
    sliding_window: int | None = None
    """Sliding-window attention: each query sees the last this-many tokens, itself included (Mistral, gpt-oss,
    Hugging Face's sliding_window); None: the whole causal context."""
    layer_types: list[str] | None = None
    """With sliding_window, each block's attention in order, "sliding_attention" or "full_attention" (Hugging
    Face's layer_types; gpt-oss alternates them); None: every block slides."""
    attention_sinks: bool = False
    """A learned logit per query head in every attention softmax's denominator, adding no value (gpt-oss)."""
    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3): this many extra depths, depth k predicting the token k + 1 places
    ahead with one more block, sharing the embedding and the output head; trained with weight
    training.mtp_loss_weight, logged as mtp_loss. 0: off (DeepSeek-V3 trains with 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vocab_size", "context_length"):
            check_positive(f"model.{name}", getattr(self, name))
        for name in ("head_dim", "mlp_hidden"):
            if getattr(self, name) is not None:
                check_positive(f"model.{name}", getattr(self, name))
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
        check_choice("model.norm", self.norm, ("layer", "rms"))
        check_choice("model.activation", self.activation, ("gelu", "swiglu"))
        check_choice("model.positions", self.positions, ("learned", "rope"))
        if self.init is not None:
            check_choice("model.init", self.init, INIT_RULES)
        if not self.rope_theta > 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be > 0 (10000, or 500000 for Llama 3)")
        self._check_rope_scaling()
        self._check_attention()
        if not isinstance(self.mtp_depth, int) or isinstance(self.mtp_depth, bool) or self.mtp_depth < 0:
            raise ConfigError(
                f"model.mtp_depth={self.mtp_depth!r} must be an integer >= 0 (0: off; DeepSeek-V3 uses 1)"
            )
        if self.mtp_depth >= self.context_length:
            raise ConfigError(
                f"model.mtp_depth={self.mtp_depth} leaves no target in a row of model.context_length="
                f"{self.context_length} tokens; choose mtp_depth < context_length (1 or 2 in practice)"
            )
        self._check_rotary_pairs()

    def _check_rotary_pairs(self) -> None:
        """Rotary positions turn pairs of a head's dims: the dims they turn must be even (a family whose
        heads rotate only some of their dims checks those)."""
        if self.positions == "rope" and self.attention_head_dim % 2:
            raise ConfigError(
                f"model.positions='rope' rotates pairs of dims: the head dim (model.head_dim, or hidden/num_heads)="
                f"{self.attention_head_dim} must be even"
            )

    def _check_attention(self) -> None:
        check_choice("model.attention_core", self.attention_core, ("auto", "sdpa", "blocksparse", "flex"))
        if self.sliding_window is not None:
            check_positive("model.sliding_window", self.sliding_window)
        if (self.attention_sinks or self.sliding_window is not None) and self.dropout:
            raise ConfigError("model.dropout runs only on plain causal attention: set it to 0 with windows or sinks")
        if self.layer_types is None:
            return
        if self.sliding_window is None:
            raise ConfigError("model.layer_types chooses which blocks slide: set model.sliding_window too, or drop it")
        kinds = ("sliding_attention", "full_attention")
        if len(self.layer_types) != self.num_layers or any(kind not in kinds for kind in self.layer_types):
            raise ConfigError(
                f"model.layer_types={self.layer_types!r} must name each of the {self.num_layers} blocks "
                f"(model.num_layers) as one of {kinds}"
            )

    def _check_rope_scaling(self) -> None:
        """One check of the scaling's numbers: :class:`RopeScaling`'s, named as ``[model]`` fields."""
        try:
            self._rope_scaling_rule()
        except ValueError as err:
            raise ConfigError(f"model.{err}") from err
        if self.rope_scale_factor != 1.0 and self.positions != "rope":
            raise ConfigError(
                f"model.rope_scale_factor={self.rope_scale_factor} scales rotary positions, but model.positions="
                f"{self.positions!r}; set positions='rope' or rope_scale_factor=1"
            )

    @property
    def rope_scaling(self) -> RopeScaling | None:
        """The rotary frequency scaling as set (Llama 3.1's or YaRN); None when the factor is 1 (none)."""
        if self.rope_scale_factor == 1.0:
            return None
        return self._rope_scaling_rule()

    def _rope_scaling_rule(self) -> RopeScaling:
        return RopeScaling(
            factor=self.rope_scale_factor,
            low_freq_factor=self.rope_low_freq_factor,
            high_freq_factor=self.rope_high_freq_factor,
            original_context=self.rope_original_context,
            kind=self.rope_type,
            beta_fast=self.rope_beta_fast,
            beta_slow=self.rope_beta_slow,
            truncate=self.rope_truncate,
            mscale=self.rope_mscale,
            mscale_all_dim=self.rope_mscale_all_dim,
            attention_factor=self.rope_attention_factor,
        )

    @property
    def init_rule(self) -> str:
        """``init``, or by the architecture when unset (see ``init``)."""
        return self.init or ("depth" if self.norm == "rms" else "gpt2")

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
    def prediction_depth(self) -> int:
        return self.mtp_depth

    @property
    def qkv_biased(self) -> bool:
        """Whether q, k and v have biases: qkv_bias, or bias when unset."""
        return self.bias if self.qkv_bias is None else self.qkv_bias


def gpt_config(model: ModelConfig) -> GPTConfig:
    """``model`` as the GPT's settings (the spec's functions are declared over every family's)."""
    if not isinstance(model, GPTConfig):
        raise ConfigError(f"model.kind={model.kind!r} is not a GPT; this needs model.kind='gpt' or 'moe-gpt'")
    return model


def gpt_shape(model: ModelConfig) -> ModelShape:
    """The GPT's block as numbers (:mod:`polyshard.models.shape`): its norm, MLP, positions and heads."""
    gpt = gpt_config(model)
    head_dim = gpt.attention_head_dim
    attention = AttentionShape(
        heads=gpt.num_heads, kv_heads=gpt.kv_heads, qk_head_dim=head_dim, v_head_dim=head_dim, qk_norm=gpt.qk_norm
    )
    return ModelShape(
        attention=attention,
        mlp_width=gpt.mlp_width,
        norm=gpt.norm,
        activation=gpt.activation,
        rotary=gpt.positions == "rope",
    )
