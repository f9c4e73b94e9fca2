"""DeepSeek-V3 (``deepseek_v3``: V3, V3.x, Kimi K2's layout) and DeepSeek-V2 (``deepseek_v2``: V2-Lite's greedy
softmax routing) in and out. The files keep one ``Linear`` per expert; polyshard stacks them, transposed.

polyshard (``layers.<i>``) -> Hugging Face (``model.layers.<i-1>``), the same layout unless it says:

* ``attn.q_proj`` (no q latent) -> ``self_attn.q_proj``; ``attn.q_down``, ``q_norm``, ``q_up`` ->
  ``self_attn.q_a_proj``, ``q_a_layernorm``, ``q_b_proj``
* ``attn.kv_down``, ``kv_norm``, ``kv_up``, ``o_proj`` -> ``self_attn.kv_a_proj_with_mqa``, ``kv_a_layernorm``,
  ``kv_b_proj``, ``o_proj``
* a dense block's ``mlp.{gate,up,down}_proj`` -> ``mlp.{gate,up,down}_proj``
* ``mlp.moe.router.weight`` -> ``mlp.gate.weight``; the selection bias ``mlp.moe.router.bias`` (a buffer) ->
  ``mlp.gate.e_score_correction_bias`` (V3 only)
* ``mlp.moe.experts.w1``, ``w3``, ``w2`` (stacked, transposed) -> ``mlp.experts.<e>.gate_proj``, ``up_proj``,
  ``down_proj``; ``mlp.shared_expert.*`` -> ``mlp.shared_experts.*``

The rotary dims stay in the file's interleaved order (MLA de-interleaves them when it runs), so import
then export is bit for bit. Refused, naming the key: another rope type than default or YaRN, grouped
key/value heads (MLA has none), ``moe_layer_freq`` other than 1, V2's ``group_limited_greedy`` routing
(a group scored by its best expert), another activation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyshard.checkpoint import CheckpointError, TensorLocation
from polyshard.models.deepseek_v3.config import DeepSeekV3Config
from polyshard.models.hf_adapter import (
    YARN_KEYS,
    HFAdapter,
    read_bool,
    read_int,
    read_number,
    read_yarn,
    require,
    shape_differences,
    yarn_parameters,
)

# What polyshard's DeepSeek computes of each family: V3 a sigmoid router with a selection bias, V2 softmax.
V3_SHAPE: dict[str, object] = {"kind": "deepseek-v3", "moe.score": "sigmoid"}
V2_SHAPE: dict[str, object] = {"kind": "deepseek-v3", "moe.score": "softmax", "moe.groups": 1, "moe.renormalize": False}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", *YARN_KEYS}


def _rope(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    """Default rotary positions or YaRN, from ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5)."""
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(name) or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: {name}={params!r} must be an object of rotary parameters")
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise CheckpointError(f"{where}: {name} holds {unknown}, which polyshard does not read")
    theta = read_number({**hf, **params}, "rope_theta", where, default=10000.0, above=0.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope.theta": theta, "rope.factor": 1.0}
    if kind != "yarn":
        raise CheckpointError(
            f"{where}: {name}.rope_type={kind!r} is not supported; polyshard computes 'default' and 'yarn'"
        )
    return {"rope.theta": theta, **read_yarn(params, f"{where}: {name}")}


def _common(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    """What V2 and V3 read alike: sizes, MLA's widths, the dense first blocks, experts, rotary positions."""
    if hf.get("quantization_config") is not None:  # DeepSeek-V3's release: FP8 blocks with weight_scale_inv
        quantization = hf["quantization_config"]
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise CheckpointError(
            f"{where}: quantization_config.quant_method={method!r} is not supported (polyshard reads bf16 or "
            "fp32 weights); convert the folder to bf16 first (DeepSeek's inference/fp8_cast_bf16.py does) "
            "and drop quantization_config from its config.json"
        )
    heads = read_int(hf, "num_attention_heads", where)
    if read_int(hf, "num_key_value_heads", where, default=heads) != heads:
        raise CheckpointError(
            f"{where}: num_key_value_heads must equal num_attention_heads={heads} (MLA has every head)"
        )
    require(hf, "hidden_act", where, ("silu", "swish"), "polyshard's SwiGLU gates with SiLU")
    require(hf, "moe_layer_freq", where, (1,), "every block after the dense ones is sparse")
    q_lora = hf.get("q_lora_rank")
    experts = read_int(hf, "n_routed_experts", where)
    top_k = read_int(hf, "num_experts_per_tok", where)
    if top_k > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
    layers = read_int(hf, "num_hidden_layers", where)
    dense = read_int(hf, "first_k_dense_replace", where, default=0, low=0)
    if dense > layers:
        raise CheckpointError(f"{where}: first_k_dense_replace={dense} exceeds num_hidden_layers={layers}")
    ffn = read_int(hf, "moe_intermediate_size", where)
    return {
        "kind": "deepseek-v3",
        "vocab_size": read_int(hf, "vocab_size", where),
        "context_length": read_int(hf, "max_position_embeddings", where),
        "hidden": read_int(hf, "hidden_size", where),
        "num_layers": layers,
        "num_heads": heads,
        "norm_eps": read_number(hf, "rms_norm_eps", where, default=1e-6, above=0.0, below=1.0),
        "tie_embeddings": read_bool(hf, "tie_word_embeddings", where, default=False),
        "mlp_hidden": read_int(hf, "intermediate_size", where),
        "q_lora_rank": None if q_lora is None else read_int(hf, "q_lora_rank", where),
        "kv_lora_rank": read_int(hf, "kv_lora_rank", where),
        "qk_nope_head_dim": read_int(hf, "qk_nope_head_dim", where),
        "qk_rope_head_dim": read_int(hf, "qk_rope_head_dim", where),
        "v_head_dim": read_int(hf, "v_head_dim", where),
        "attention_bias": read_bool(hf, "attention_bias", where, default=False),
        "moe.dense_layers": list(range(dense)),
        "moe.num_experts": experts,
        "moe.top_k": top_k,
        "moe.ffn_hidden": ffn,
        "moe.shared_experts": read_int(hf, "n_shared_experts", where, default=0, low=0),
        "moe.shared_ffn_hidden": ffn,
        "moe.scale": read_number(hf, "routed_scaling_factor", where, default=1.0, above=0.0),
        **_rope(hf, where),
    }


def v3_settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    settings = _common(hf, where)
    groups = read_int(hf, "n_group", where, default=1)
    if settings["moe.num_experts"] % groups:  # type: ignore[operator]
        raise CheckpointError(
            f"{where}: n_group={groups} does not divide n_routed_experts={settings['moe.num_experts']}"
        )
    return {
        **settings,
        **V3_SHAPE,
        "rope_interleave": read_bool(hf, "rope_interleave", where, default=True),
        "moe.groups": groups,
        "moe.group_topk": read_int(hf, "topk_group", where, default=1),
        "moe.renormalize": read_bool(hf, "norm_topk_prob", where, default=True),
    }


def v2_settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    require(hf, "topk_method", where, ("greedy",), "V2's group_limited_greedy scores a group by its best expert")
    return {**_common(hf, where), **V2_SHAPE, "rope_interleave": True}


def locations(model: DeepSeekV3Config) -> dict[str, TensorLocation]:
    """Our name -> where it lives in a DeepSeek file (the selection bias too, when the router has one)."""
    last = model.num_layers + 1
    out = {"layers.0.tok.weight": TensorLocation("model.embed_tokens.weight")}
    attn = {"kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "kv_up": "kv_b_proj", "o_proj": "o_proj"}
    if model.q_lora_rank is None:
        attn["q_proj"] = "q_proj"
    else:
        attn |= {"q_down": "q_a_proj", "q_norm": "q_a_layernorm", "q_up": "q_b_proj"}
    biased = {"kv_down", "q_down", "o_proj"} if model.attention_bias else set()
    for i in range(1, last):
        hf, ours = f"model.layers.{i - 1}", f"layers.{i}"
        out[f"{ours}.norm1.weight"] = TensorLocation(f"{hf}.input_layernorm.weight")
        out[f"{ours}.norm2.weight"] = TensorLocation(f"{hf}.post_attention_layernorm.weight")
        for mine, theirs in attn.items():
            out[f"{ours}.attn.{mine}.weight"] = TensorLocation(f"{hf}.self_attn.{theirs}.weight")
            if mine in biased:
                out[f"{ours}.attn.{mine}.bias"] = TensorLocation(f"{hf}.self_attn.{theirs}.bias")
        if not model.sparse_layer(i - 1):
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{ours}.mlp.{p}.weight"] = TensorLocation(f"{hf}.mlp.{p}.weight")
            continue
        out[f"{ours}.mlp.moe.router.weight"] = TensorLocation(f"{hf}.mlp.gate.weight")
        if model.moe.score == "sigmoid":
            out[f"{ours}.mlp.moe.router.bias"] = TensorLocation(f"{hf}.mlp.gate.e_score_correction_bias")
        for w, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            stacked = tuple(f"{hf}.mlp.experts.{e}.{p}.weight" for e in range(model.moe.num_experts))
            out[f"{ours}.mlp.moe.experts.{w}"] = TensorLocation(stacked[0], transposed=True, stacked=stacked)
        if model.moe.shared_experts:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{ours}.mlp.shared_expert.{p}.weight"] = TensorLocation(f"{hf}.mlp.shared_experts.{p}.weight")
    out[f"layers.{last}.norm.weight"] = TensorLocation("model.norm.weight")
    if not model.tie_embeddings:
        out[f"layers.{last}.proj.weight"] = TensorLocation("lm_head.weight")
    return out


def _first_dense(model: DeepSeekV3Config) -> int:
    """first_k_dense_replace: DeepSeek's config can only name the first k blocks dense."""
    dense = sorted(set(model.moe.dense_layers))
    if dense != list(range(len(dense))):
        raise CheckpointError(
            f"model.moe.dense_layers={model.moe.dense_layers!r}: DeepSeek's config.json keeps only the first k "
            f"blocks dense (first_k_dense_replace); name blocks 0..k-1, e.g. {list(range(len(dense)))}"
        )
    return len(dense)


def _config(model: DeepSeekV3Config) -> dict[str, object]:
    rope = yarn_parameters(model.rope)
    return {
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.context_length,
        "hidden_size": model.hidden,
        "intermediate_size": model.mlp_width,
        "moe_intermediate_size": model.expert_width,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_heads,
        "n_shared_experts": model.moe.shared_experts,
        "n_routed_experts": model.moe.num_experts,
        "routed_scaling_factor": model.moe.scale,
        "kv_lora_rank": model.kv_lora_rank,
        "q_lora_rank": model.q_lora_rank,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "num_experts_per_tok": model.moe.top_k,
        "first_k_dense_replace": _first_dense(model),
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "rope_parameters": rope,
        "attention_bias": model.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": "float32",
    }


def v3_config(model: DeepSeekV3Config) -> dict[str, object]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **_config(model),
        "n_group": model.moe.groups,
        "topk_group": model.moe.group_topk,
        "norm_topk_prob": model.moe.renormalize,
        "rope_interleave": model.rope_interleave,
    }


def v2_config(model: DeepSeekV3Config) -> dict[str, object]:
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        **_config(model),
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
    }


def _family(model_type: str, title: str, shape: Mapping[str, object], settings: Any, config: Any) -> HFAdapter:
    return HFAdapter(
        model_type=model_type,
        title=title,
        settings=settings,
        differences=lambda model: shape_differences(model, shape),
        locations=locations,
        config=config,
        base_prefix="model.",
        base_names=("embed_tokens.", "layers.", "norm."),
        at_most=frozenset({"context_length"}),  # rotary positions: any shorter sequence works
    )


DEEPSEEK_V3 = _family("deepseek_v3", "DeepSeek-V3", V3_SHAPE, v3_settings, v3_config)
DEEPSEEK_V2 = _family("deepseek_v2", "DeepSeek-V2", V2_SHAPE, v2_settings, v2_config)
