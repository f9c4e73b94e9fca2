"""Llama (``LlamaForCausalLM``): RMSNorm, SwiGLU, rotary positions (Llama 3.1's frequency scaling
too), no biases, grouped-query attention. Every weight is a plain ``Linear`` weight under another
name: no transposes, and no permutation of q and k, because polyshard's rotary embedding pairs dims
i and i + D/2 as Hugging Face's ``rotate_half`` does."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from polyshard.checkpoint import CheckpointError, TensorLocation
from polyshard.models.decoder import GroupedAttention
from polyshard.models.gpt.presets import LLAMA
from polyshard.models.hf_adapter import (
    FULL_ATTENTION,
    HFAdapter,
    read_bool,
    read_int,
    read_number,
    require,
    shape_differences,
)

# The settings that make polyshard's GPT Llama's architecture.
SHAPE: dict[str, object] = {"kind": "gpt", **LLAMA, "qkv_bias": False, "qk_norm": False, **FULL_ATTENTION}
# What a rotary-parameters object may hold (transformers 4's rope_scaling, 5's rope_parameters).
_ROPE_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings", "partial_rotary_factor",
}  # fmt: skip


def settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    """``config.json`` -> polyshard's ``[model]`` settings; whatever polyshard's Llama cannot compute is refused."""
    require(hf, "attention_bias", where, (False,), "polyshard's Llama has no biases")
    require(hf, "mlp_bias", where, (False,), "polyshard's Llama has no biases")
    return {**SHAPE, **decoder_settings(hf, where), "mlp_hidden": read_int(hf, "intermediate_size", where)}


def decoder_settings(
    hf: Mapping[str, Any], where: str, *, head_dim: int | None = None, theta: float = 10000.0, eps: float = 1e-6
) -> dict[str, object]:
    """The settings every Llama-like family (Llama, Mixtral, Qwen) reads alike: sizes, grouped-query
    heads, the head dim (``head_dim`` when the key is absent, as the family's transformers class
    defaults it; None: hidden / heads), SiLU, RMSNorm's epsilon (default ``eps``) and rotary
    positions (default base ``theta``)."""
    hidden, heads = read_int(hf, "hidden_size", where), read_int(hf, "num_attention_heads", where)
    kv_heads = read_int(hf, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise CheckpointError(f"{where}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    if head_dim is None and hidden % heads:
        raise CheckpointError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    dims = read_int(hf, "head_dim", where, default=head_dim or hidden // heads)
    if dims % 2:
        raise CheckpointError(f"{where}: head_dim={dims} must be even (rotary positions rotate pairs of dims)")
    require(hf, "hidden_act", where, ("silu", "swish"), "polyshard's SwiGLU gates with SiLU")
    context = read_int(hf, "max_position_embeddings", where)
    return {
        "vocab_size": read_int(hf, "vocab_size", where),
        "context_length": context,
        "hidden": hidden,
        "num_layers": read_int(hf, "num_hidden_layers", where),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": dims,
        "tie_embeddings": read_bool(hf, "tie_word_embeddings", where, default=False),
        "norm_eps": read_number(hf, "rms_norm_eps", where, default=eps, above=0.0, below=1.0),
        **_rope(hf, where, context, theta),
    }


def _rope(hf: Mapping[str, Any], where: str, context: int, default_theta: float = 10000.0) -> dict[str, object]:
    """The rotary settings, read as transformers 5 reads them: ``rope_scaling`` (transformers 4's name)
    wins over ``rope_parameters``; a ``rope_theta`` inside wins over one at the top level (default
    ``default_theta``, the family's); Llama 3.1's scaling (type ``llama3``) takes its original context from a top-level
    ``original_max_position_embeddings``, else its own, else ``max_position_embeddings``."""
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(name) or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: {name}={params!r} must be an object of rotary parameters")
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise CheckpointError(
            f"{where}: {name} holds {unknown}, which polyshard does not read; it knows {sorted(_ROPE_KEYS)}"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise CheckpointError(
            f"{where}: {name}.rope_type={kind!r} is not supported; polyshard computes 'default' and 'llama3' rotary "
            "frequencies"
        )
    partial = {**hf, **params}.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise CheckpointError(
            f"{where}: partial_rotary_factor={partial!r} is not supported; polyshard rotates every dim of a head"
        )
    theta = read_number({**hf, **params}, "rope_theta", where, default=default_theta, above=0.0)
    if kind == "default":
        return {"rope.theta": theta, "rope.scaling": "none", "rope.factor": 1.0}
    inside = f"{where}: {name}"
    factor = read_number(params, "factor", inside, above=0.0)
    if factor < 1.0:
        raise CheckpointError(f"{inside}: factor={factor} must be >= 1 (Llama 3.1 stretches its context)")
    low = read_number(params, "low_freq_factor", inside, above=0.0)
    if hf.get("original_max_position_embeddings") is not None:
        original = read_int(hf, "original_max_position_embeddings", where)
    else:
        original = read_int(params, "original_max_position_embeddings", inside, default=context)
    return {
        "rope.theta": theta,
        "rope.scaling": "llama3",
        "rope.factor": factor,
        "rope.low_freq_factor": low,
        "rope.high_freq_factor": read_number(params, "high_freq_factor", inside, above=low),
        "rope.original_context": original,
    }


def differences(model: GroupedAttention) -> dict[str, object]:
    return shape_differences(model, {**SHAPE, **llama3_rope(model)})


def llama3_rope(model: Any) -> dict[str, object]:
    """What a Llama-like file needs of a model's rotary scaling: Llama 3.1's rule, when it scales at all
    (their config.json writes only that rule)."""
    return {"rope.scaling": "llama3"} if model.rope.stretched else {}


def locations(model: GroupedAttention) -> dict[str, TensorLocation]:
    """Our parameter name -> where it lives in a Llama file (the same layout, other names)."""
    return decoder_locations(model, dense_mlp)


def dense_mlp(ours: str, hf: str) -> dict[str, TensorLocation]:
    """A dense SwiGLU's three matrices: ``mlp.{gate,up,down}_proj`` in both."""
    return {
        f"{ours}.mlp.{p}.weight": TensorLocation(f"{hf}.mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")
    }


def decoder_locations(
    model: GroupedAttention, mlp: Callable[[str, str], dict[str, TensorLocation]]
) -> dict[str, TensorLocation]:
    """The names of a Llama-like file (Llama, Mixtral, Qwen): embedding, each block's norms and attention
    (with q/k/v biases and q/k norms where ``model`` has them), its MLP as ``mlp(ours, hf)`` places it
    (our ``layers.<i>``, their ``model.layers.<i-1>``), the final norm and an untied head."""
    last = model.num_layers + 1
    out = {"layers.0.tok.weight": TensorLocation("model.embed_tokens.weight")}
    for i in range(1, last):
        hf, ours = f"model.layers.{i - 1}", f"layers.{i}"
        out[f"{ours}.norm1.weight"] = TensorLocation(f"{hf}.input_layernorm.weight")
        out[f"{ours}.norm2.weight"] = TensorLocation(f"{hf}.post_attention_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{ours}.attn.{proj}.weight"] = TensorLocation(f"{hf}.self_attn.{proj}.weight")
            if model.qkv_biased and proj != "o_proj":
                out[f"{ours}.attn.{proj}.bias"] = TensorLocation(f"{hf}.self_attn.{proj}.bias")
        if model.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out[f"{ours}.attn.{norm}.weight"] = TensorLocation(f"{hf}.self_attn.{norm}.weight")
        out |= mlp(ours, hf)
    out[f"layers.{last}.norm.weight"] = TensorLocation("model.norm.weight")
    if not model.tie_embeddings:
        out[f"layers.{last}.proj.weight"] = TensorLocation("lm_head.weight")
    return out


def config(model: GroupedAttention) -> dict[str, object]:
    """``config.json`` in the names transformers 4 writes (``rope_theta``, ``rope_scaling``), which
    transformers 5 reads too. ``max_position_embeddings`` is the context polyshard trained on."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_config_json(model),
        "intermediate_size": model.mlp_width,
        "attention_bias": False,
        "mlp_bias": False,
    }


def decoder_config_json(model: GroupedAttention) -> dict[str, object]:
    """The ``config.json`` entries every Llama-like family writes alike (:func:`decoder_settings`'s)."""
    scaling = None
    if model.rope.stretched:
        scaling = {
            "rope_type": "llama3",
            "factor": model.rope.factor,
            "low_freq_factor": model.rope.low_freq_factor,
            "high_freq_factor": model.rope.high_freq_factor,
            "original_max_position_embeddings": model.rope.original_context,
        }
    return {
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.context_length,
        "hidden_size": model.hidden,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.attention_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope.theta,
        "rope_scaling": scaling,
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": "float32",
    }


LLAMA_FAMILY = HFAdapter(
    model_type="llama",
    title="Llama",
    settings=settings,
    differences=differences,
    locations=locations,
    config=config,
    base_prefix="model.",  # LlamaModel's files: embed_tokens, layers, norm without "model."
    base_names=("embed_tokens.", "layers.", "norm."),
    buffers=(".rotary_emb.inv_freq",),  # saved by transformers before 4.31; recomputed from the config
    at_most=frozenset({"context_length"}),  # rotary positions: any shorter sequence works
)


def decoder_family(
    model_type: str,
    title: str,
    shape: Mapping[str, object],
    settings: Callable[[Mapping[str, Any], str], dict[str, object]],
    locations: Callable[[Any], dict[str, TensorLocation]],
    config: Callable[[Any], dict[str, object]],
) -> HFAdapter:
    """A Llama-like family (Qwen2, Qwen3, Mixtral, Qwen-MoE): Llama's file layout under ``model.``, a
    model of the family has ``shape``'s settings, and it may train on sequences shorter than its folder's."""
    return HFAdapter(
        model_type=model_type,
        title=title,
        settings=settings,
        differences=lambda model: shape_differences(model, {**shape, **llama3_rope(model)}),
        locations=locations,
        config=config,
        base_prefix="model.",  # the base model's files: embed_tokens, layers, norm without "model."
        base_names=("embed_tokens.", "layers.", "norm."),
        at_most=frozenset({"context_length"}),  # rotary positions: any shorter sequence works
    )
