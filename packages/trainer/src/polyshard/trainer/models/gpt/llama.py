"""Llama (``LlamaForCausalLM``): RMSNorm, SwiGLU, rotary positions (Llama 3.1's frequency scaling
too), no biases, grouped-query attention. Every weight is a plain ``Linear`` weight under another
name: no transposes, and no permutation of q and k, because polyshard's rotary embedding pairs dims
i and i + D/2 as Hugging Face's ``rotate_half`` does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyshard.checkpoint import CheckpointError, TensorLocation
from polyshard.trainer.config import LLAMA, ModelConfig
from polyshard.trainer.models.hf_adapter import Family, read_bool, read_int, read_number, require, shape_differences

# The settings that make polyshard's GPT Llama's architecture.
SHAPE: dict[str, object] = {"kind": "gpt", **LLAMA}
# What a rotary-parameters object may hold (transformers 4's rope_scaling, 5's rope_parameters).
_ROPE_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings", "partial_rotary_factor",
}  # fmt: skip


def settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    """``config.json`` -> polyshard's ``[model]`` settings; whatever polyshard's Llama cannot compute is refused."""
    hidden, heads = read_int(hf, "hidden_size", where), read_int(hf, "num_attention_heads", where)
    if hidden % heads:
        raise CheckpointError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    kv_heads = read_int(hf, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise CheckpointError(f"{where}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    head_dim = read_int(hf, "head_dim", where, default=hidden // heads)
    if head_dim != hidden // heads:
        raise CheckpointError(
            f"{where}: head_dim={head_dim} is not supported; polyshard's attention uses hidden_size / "
            f"num_attention_heads = {hidden // heads}"
        )
    if head_dim % 2:
        raise CheckpointError(f"{where}: head_dim={head_dim} must be even (rotary positions rotate pairs of dims)")
    require(hf, "hidden_act", where, ("silu", "swish"), "polyshard's SwiGLU gates with SiLU")
    require(hf, "attention_bias", where, (False,), "polyshard's Llama has no biases")
    require(hf, "mlp_bias", where, (False,), "polyshard's Llama has no biases")
    context = read_int(hf, "max_position_embeddings", where)
    return {
        **SHAPE,
        "vocab_size": read_int(hf, "vocab_size", where),
        "context_length": context,
        "hidden": hidden,
        "num_layers": read_int(hf, "num_hidden_layers", where),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "mlp_hidden": read_int(hf, "intermediate_size", where),
        "tie_embeddings": read_bool(hf, "tie_word_embeddings", where, default=False),
        "norm_eps": read_number(hf, "rms_norm_eps", where, default=1e-6, above=0.0, below=1.0),
        **_rope(hf, where, context),
    }


def _rope(hf: Mapping[str, Any], where: str, context: int) -> dict[str, object]:
    """The rotary settings, read as transformers 5 reads them: ``rope_scaling`` (transformers 4's name)
    wins over ``rope_parameters``; a ``rope_theta`` inside wins over one at the top level (default
    10000); Llama 3.1's scaling (type ``llama3``) takes its original context from a top-level
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
    theta = read_number({**hf, **params}, "rope_theta", where, default=10000.0, above=0.0)
    if kind == "default":
        return {"rope_theta": theta, "rope_scale_factor": 1.0}
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
        "rope_theta": theta,
        "rope_scale_factor": factor,
        "rope_low_freq_factor": low,
        "rope_high_freq_factor": read_number(params, "high_freq_factor", inside, above=low),
        "rope_original_context": original,
    }


def differences(model: ModelConfig) -> dict[str, object]:
    return shape_differences(model, SHAPE)


def locations(model: ModelConfig) -> dict[str, TensorLocation]:
    """Our parameter name -> where it lives in a Llama file (the same layout, other names)."""
    last = model.num_layers + 1
    out = {"layers.0.tok.weight": TensorLocation("model.embed_tokens.weight")}
    for i in range(1, last):
        hf, ours = f"model.layers.{i - 1}", f"layers.{i}"
        out[f"{ours}.norm1.weight"] = TensorLocation(f"{hf}.input_layernorm.weight")
        out[f"{ours}.norm2.weight"] = TensorLocation(f"{hf}.post_attention_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{ours}.attn.{proj}.weight"] = TensorLocation(f"{hf}.self_attn.{proj}.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{ours}.mlp.{proj}.weight"] = TensorLocation(f"{hf}.mlp.{proj}.weight")
    out[f"layers.{last}.norm.weight"] = TensorLocation("model.norm.weight")
    if not model.tie_embeddings:
        out[f"layers.{last}.proj.weight"] = TensorLocation("lm_head.weight")
    return out


def config(model: ModelConfig) -> dict[str, object]:
    """``config.json`` in the names transformers 4 writes (``rope_theta``, ``rope_scaling``), which
    transformers 5 reads too. ``max_position_embeddings`` is the context polyshard trained on."""
    scaling = None
    if model.rope_scale_factor != 1.0:
        scaling = {
            "rope_type": "llama3",
            "factor": model.rope_scale_factor,
            "low_freq_factor": model.rope_low_freq_factor,
            "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_context,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.context_length,
        "hidden_size": model.hidden,
        "intermediate_size": model.mlp_width,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.hidden // model.num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": "float32",
    }


LLAMA_FAMILY = Family(
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
