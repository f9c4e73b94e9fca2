"""The parts a decoder-only family's settings are made of. A family's config is the parts its model has,
its defaults and its own checks; no family's config is another's with fields refused:

* :class:`DecoderConfig`: what every decoder has (vocabulary, context, norms, the dense MLP, positions
  with ``[model.rope]``, initialisation, the attention core, multi-token prediction);
* an attention: :class:`GroupedAttention` (softmax attention over grouped key/value heads: GPT-2, Llama,
  Qwen, Mistral, gpt-oss; its widths, biases, q/k norm, windows, sinks) or :class:`LatentAttention`
  (DeepSeek's multi-head latent attention: the latents' and heads' widths);
* optionally :class:`Experts` (``[model.moe]``: mixture-of-experts MLPs in every block but the dense ones).

``gpt`` is a decoder with grouped attention, ``moe-gpt`` adds experts, ``gpt-oss`` is the same parts with
gpt-oss's defaults, ``deepseek-v3`` is latent attention with experts. Each part checks its own fields when
built; the checks between parts are the decoder's (rotary pairs: the dims the attention rotates).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from polyshard.mesh import divisors
from polyshard.models.common.moe import MoEConfig
from polyshard.models.common.rotary import RopeConfig, yarn_mscale
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError, check_choice, check_positive
from polyshard.models.shape import AttentionShape, ExpertShape, ModelShape

INIT_RULES = ("gpt2", "depth")
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(kw_only=True, frozen=True)
class DecoderConfig(ModelConfig):
    """What every decoder-only language model has; an attention part completes it."""

    vocab_size: int = 256
    """Tokens in the vocabulary; 256 for the byte-level tokenizer."""
    context_length: int = 64
    """Tokens per sequence — the packing length."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
    norm: str = "layer"
    """layer (LayerNorm, GPT-2) or rms (RMSNorm, Llama)."""
    activation: str = "gelu"
    """The MLP: gelu (GPT-2's tanh GELU) or swiglu (Llama's gated SiLU, three matrices)."""
    positions: str = "learned"
    """learned (a position table, GPT-2) or rope (rotary embeddings on q and k, Llama; see [model.rope])."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary positions' base and frequency scaling (``[model.rope]``) when positions = 'rope'."""
    bias: bool = True
    """Biases in the attention and MLP projections (GPT-2 has them, Llama not)."""
    mlp_hidden: int | None = None
    """MLP width; None means mlp_ratio x hidden (Llama's intermediate_size)."""
    init: str | None = None
    """The initial weights: 'gpt2' (N(0, 0.02), output projections / sqrt(2 x layers)) or 'depth'
    (torchtitan's and Megatron's for Llama: embedding N(0, 1), each block's output projections
    0.02 / sqrt(2 x its depth), the head hidden^-0.5; truncated normals). None: 'depth' for RMSNorm
    (Llama-like) models, 'gpt2' for the others."""
    attention_core: str = "auto"
    """The attention core: auto (plain causal SDPA when nothing is masked; with document masks, sliding windows
    or sinks FlexAttention on CUDA, else blocksparse), sdpa, blocksparse (online softmax over key/value blocks,
    skipping the hidden ones; any device) or flex (FlexAttention, CUDA). Context parallelism runs its own."""
    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3): this many extra depths, depth k predicting the token k + 1 places
    ahead with one more block, sharing the embedding and the output head; trained with weight
    training.mtp_loss_weight, logged as mtp_loss. 0: off (DeepSeek-V3 trains with 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vocab_size", "context_length"):
            check_positive(f"model.{name}", getattr(self, name))
        if self.mlp_hidden is not None:
            check_positive("model.mlp_hidden", self.mlp_hidden)
        check_choice("model.norm", self.norm, ("layer", "rms"))
        check_choice("model.activation", self.activation, ("gelu", "swiglu"))
        check_choice("model.positions", self.positions, ("learned", "rope"))
        check_choice("model.attention_core", self.attention_core, ("auto", "sdpa", "blocksparse", "flex"))
        if self.init is not None:
            check_choice("model.init", self.init, INIT_RULES)
        self._check_attention()
        if not isinstance(self.rope, RopeConfig):
            raise ConfigError(f"model.rope must be a table ([model.rope]), not {self.rope!r}")
        if self.rope.stretched and self.positions != "rope":
            raise ConfigError(
                f"model.rope.factor={self.rope.factor} scales rotary positions, but model.positions="
                f"{self.positions!r}; set positions='rope' or rope.factor=1"
            )
        if self.positions == "rope" and self.rotary_dims % 2:
            raise ConfigError(
                f"{self.rotary_dims_name}={self.rotary_dims} must be even (rotary positions turn pairs of dims)"
            )
        if not isinstance(self.mtp_depth, int) or isinstance(self.mtp_depth, bool) or self.mtp_depth < 0:
            raise ConfigError(
                f"model.mtp_depth={self.mtp_depth!r} must be an integer >= 0 (0: off; DeepSeek-V3 uses 1)"
            )
        if self.mtp_depth >= self.context_length:
            raise ConfigError(
                f"model.mtp_depth={self.mtp_depth} leaves no target in a row of model.context_length="
                f"{self.context_length} tokens; choose mtp_depth < context_length (1 or 2 in practice)"
            )

    def _check_attention(self) -> None:
        """The attention part's own checks, before those that read its widths."""

    @property
    def attention_shape(self) -> AttentionShape:
        """The attention as numbers; each attention part gives its own."""
        raise NotImplementedError(f"{type(self).__name__} has no attention part (GroupedAttention, LatentAttention)")

    @property
    def rotary_dims(self) -> int:
        """Dims of each head that rotary positions turn; each attention part says which."""
        raise NotImplementedError(f"{type(self).__name__} has no attention part (GroupedAttention, LatentAttention)")

    @property
    def rotary_dims_name(self) -> str:
        """The setting :attr:`rotary_dims` comes from, for messages."""
        raise NotImplementedError(f"{type(self).__name__} has no attention part (GroupedAttention, LatentAttention)")

    @property
    def init_rule(self) -> str:
        """``init``, or by the architecture when unset (see ``init``)."""
        return self.init or ("depth" if self.norm == "rms" else "gpt2")

    @property
    def mlp_width(self) -> int:
        return self.mlp_hidden or self.mlp_ratio * self.hidden

    @property
    def prediction_depth(self) -> int:
        return self.mtp_depth


@dataclass(kw_only=True, frozen=True)
class GroupedAttention(DecoderConfig):
    """Softmax attention over ``num_kv_heads`` key/value heads shared by groups of query heads."""

    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means num_heads."""
    head_dim: int | None = None
    """Dims of each attention head; None means hidden / num_heads (Qwen3 uses 128 at every width)."""
    qkv_bias: bool | None = None
    """Biases on the q, k and v projections; None follows bias (Qwen2 has them, but none on o or the MLP)."""
    qk_norm: bool = False
    """An RMSNorm over each head's q and k, before rotary positions (Qwen3); its weight is per head dim."""
    sliding_window: int | None = None
    """Sliding-window attention: each query sees the last this-many tokens, itself included (Mistral, gpt-oss,
    Hugging Face's sliding_window); None: the whole causal context."""
    layer_types: list[str] | None = None
    """With sliding_window, each block's attention in order, "sliding_attention" or "full_attention" (Hugging
    Face's layer_types; gpt-oss alternates them); None: every block slides."""
    attention_sinks: bool = False
    """A learned logit per query head in every attention softmax's denominator, adding no value (gpt-oss)."""

    def _check_attention(self) -> None:
        if self.head_dim is not None:
            check_positive("model.head_dim", self.head_dim)
        elif self.hidden % self.num_heads:
            raise ConfigError(
                f"model.hidden={self.hidden} is not a multiple of model.num_heads={self.num_heads}; "
                f"choose num_heads in {divisors(self.hidden)}"
            )
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads}; "
                f"choose one of {divisors(self.num_heads)}"
            )
        if self.sliding_window is not None:
            check_positive("model.sliding_window", self.sliding_window)
        if (self.attention_sinks or self.sliding_window is not None) and self.dropout:
            raise ConfigError("model.dropout runs only on plain causal attention: set it to 0 with windows or sinks")
        if self.layer_types is None:
            return
        if self.sliding_window is None:
            raise ConfigError("model.layer_types chooses which blocks slide: set model.sliding_window too, or drop it")
        if len(self.layer_types) != self.num_layers or any(kind not in LAYER_TYPES for kind in self.layer_types):
            raise ConfigError(
                f"model.layer_types={self.layer_types!r} must name each of the {self.num_layers} blocks "
                f"(model.num_layers) as one of {LAYER_TYPES}"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def attention_head_dim(self) -> int:
        """Dims per attention head: head_dim, or hidden / num_heads when unset."""
        return self.head_dim or self.hidden // self.num_heads

    @property
    def rotary_dims(self) -> int:
        """Every dim of a head rotates."""
        return self.attention_head_dim

    @property
    def rotary_dims_name(self) -> str:
        return "the head dim (model.head_dim, or hidden/num_heads)"

    @property
    def qkv_biased(self) -> bool:
        """Whether q, k and v have biases: qkv_bias, or bias when unset."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def attention_shape(self) -> AttentionShape:
        dims = self.attention_head_dim
        return AttentionShape(
            heads=self.num_heads, kv_heads=self.kv_heads, qk_head_dim=dims, v_head_dim=dims, qk_norm=self.qk_norm
        )


@dataclass(kw_only=True, frozen=True)
class LatentAttention(DecoderConfig):
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values from one shared latent, queries from
    their own (or the hidden state), each head's q/k split into non-rotary and rotary dims, one rotary key
    shared by every head."""

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

    def _check_attention(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_positive(f"model.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            check_positive("model.q_lora_rank", self.q_lora_rank)

    @property
    def rotary_dims(self) -> int:
        """Only each head's qk_rope_head_dim dims rotate (the non-rotary ones may be odd)."""
        return self.qk_rope_head_dim

    @property
    def rotary_dims_name(self) -> str:
        return "model.qk_rope_head_dim"

    @property
    def attention_head_dim(self) -> int:
        """Dims of each head's query and key: non-rotary and rotary."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(q/k head dim), times YaRN's mscale(factor, mscale_all_dim) squared when it stretches."""
        scale: float = self.attention_head_dim**-0.5
        if self.rope.stretched and self.rope.mscale_all_dim:
            scale = scale * yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return scale

    @property
    def attention_shape(self) -> AttentionShape:
        """q/k heads of Dn + Dr dims, values of their own width, the latents and the shared rotary key."""
        return AttentionShape(
            heads=self.num_heads,
            kv_heads=self.num_heads,
            qk_head_dim=self.attention_head_dim,
            v_head_dim=self.v_head_dim,
            kv_latent=self.kv_lora_rank,
            q_latent=self.q_lora_rank or 0,
            shared_key_dim=self.qk_rope_head_dim,
        )


@dataclass(kw_only=True, frozen=True)
class Experts(DecoderConfig):
    """Every block's MLP (but ``moe.dense_layers``') a mixture of experts (``[model.moe]``)."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    """The experts, their router and losses, and the shared and dense MLPs beside them (``[model.moe]``)."""
    all_dense_allowed: ClassVar[bool] = False
    """Whether every block may be dense (a family whose model stands without experts, as DeepSeek's MLA)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.moe, MoEConfig):
            raise ConfigError(f"model.moe must be a table ([model.moe]), not {self.moe!r}")
        dense = self.moe.dense_layers
        outside = [i for i in dense if i >= self.num_layers]
        if outside:
            raise ConfigError(
                f"model.moe.dense_layers={dense!r} names blocks {outside} past the last block "
                f"({self.num_layers - 1}; blocks count from 0); keep indices below model.num_layers={self.num_layers}"
            )
        if len(set(dense)) == self.num_layers and not self.all_dense_allowed:
            raise ConfigError(
                f"model.moe.dense_layers={dense!r} leaves no block with experts; use model.kind='gpt' for a dense "
                "model, or leave at least one block out of dense_layers"
            )

    def sparse_layer(self, i: int) -> bool:
        """Whether block ``i`` (0-based; pipeline layer ``i + 1``) holds experts rather than a dense MLP."""
        return i not in self.moe.dense_layers

    @property
    def sparse_layers(self) -> list[int]:
        """The blocks (0-based) that hold experts."""
        return [i for i in range(self.num_layers) if self.sparse_layer(i)]

    @property
    def dense_width(self) -> int:
        """Width of the dense blocks' MLP: moe.dense_ffn_hidden, or the model's MLP width when unset."""
        return self.moe.dense_ffn_hidden or self.mlp_width

    @property
    def expert_width(self) -> int:
        """Width of each routed expert: moe.ffn_hidden, or the MLP width / top_k when unset."""
        return self.moe.expert_width(self.mlp_width)

    @property
    def shared_width(self) -> int:
        """Width of the shared experts' one MLP; 0 without them."""
        return self.moe.shared_width(self.mlp_width)


# -- the spec's functions over the parts (declared over every family's config) ---------------------------


Part = TypeVar("Part", bound=ModelConfig)


def _as(model: ModelConfig, part: type[Part], needs: str) -> Part:
    if not isinstance(model, part):
        raise ConfigError(f"model.kind={model.kind!r} has no {needs}")
    return model


def decoder_config(model: ModelConfig) -> DecoderConfig:
    """``model`` as a decoder's settings."""
    return _as(model, DecoderConfig, "decoder (a language model's family is needed)")


def grouped_attention(model: ModelConfig) -> GroupedAttention:
    """``model`` as a decoder with grouped-query attention (gpt, moe-gpt, gpt-oss)."""
    return _as(model, GroupedAttention, "grouped-query attention (model.kind='gpt', 'moe-gpt' or 'gpt-oss')")


def moe_config(model: ModelConfig) -> Experts:
    """``model`` as a decoder with experts (moe-gpt, gpt-oss, deepseek-v3)."""
    return _as(model, Experts, "experts; this needs model.kind='moe-gpt', 'gpt-oss' or 'deepseek-v3'")


def decoder_shape(model: ModelConfig) -> ModelShape:
    """The decoder's block as numbers (:mod:`polyshard.models.shape`): its attention part's shape, norm,
    MLP and positions, and its experts (every block but ``moe.dense_layers``, which keep a dense MLP of
    their own width) when it has them."""
    config = decoder_config(model)
    shape = ModelShape(
        attention=config.attention_shape,
        mlp_width=config.mlp_width,
        norm=config.norm,
        activation=config.activation,
        rotary=config.positions == "rope",
    )
    if not isinstance(config, Experts):
        return shape
    routed = ExpertShape(config.moe.num_experts, config.moe.top_k, config.expert_width, config.shared_width)
    dense = frozenset(config.moe.dense_layers)
    return dataclasses.replace(shape, mlp_width=config.dense_width, experts=routed, dense_blocks=dense)
