"""gpt-oss (``GptOssForCausalLM``, ``model_type: gpt_oss``) in and out.

Llama's names for the embedding, norms and q/k/v/o (each with a bias), plus:

=========================================  =========================================  ======
polyshard (``layers.<i>``)                 Hugging Face (``model.layers.<i-1>``)      layout
=========================================  =========================================  ======
``attn.o_proj.bias``, ``attn.sinks`` (N,)   ``self_attn.o_proj.bias``, ``self_attn.sinks``  same
``mlp.moe.router.weight`` (E, H)            ``mlp.router.weight``                      same
``mlp.moe.router.logit_bias`` (E,)          ``mlp.router.bias``                        same
``mlp.moe.experts.w1`` (E, H, 2F)           ``mlp.experts.gate_up_proj``               same
``mlp.moe.experts.w1_bias`` (E, 2F)         ``mlp.experts.gate_up_proj_bias``          same
``mlp.moe.experts.w2`` (E, F, H)            ``mlp.experts.down_proj``                  same
``mlp.moe.experts.w2_bias`` (E, H)          ``mlp.experts.down_proj_bias``             same
=========================================  =========================================  ======

polyshard's clamped-SwiGLU experts keep gate and up interleaved in one tensor as gpt-oss does (gate in
the even columns), so every tensor is a copy and an ep rank reads only its experts' rows of each.

OpenAI's released folders store the experts' matrices in MXFP4 (``*_blocks`` of 4-bit values and
``*_scales``, with ``quantization_config.quant_method = "mxfp4"`` in config.json): they are dequantized on
import (:mod:`polyshard.checkpoint.mxfp4`), each ep rank decoding only its experts' blocks. An export
writes the dequantized (or trained) tensors plainly. Another quantization method is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyshard.checkpoint import CheckpointError, TensorLocation
from polyshard.models.gpt.hf_llama import decoder_config_json, decoder_locations, decoder_settings
from polyshard.models.gpt_oss.config import GptOssConfig
from polyshard.models.hf_adapter import (
    HFAdapter,
    read_bool,
    read_int,
    read_number,
    read_yarn,
    shape_differences,
    yarn_parameters,
)

# What makes a model gpt-oss's architecture (beyond the sizes and values a folder gives).
SHAPE: dict[str, object] = {
    "kind": "gpt-oss", "norm": "rms", "positions": "rope", "attention_sinks": True, "qk_norm": False,
    "moe.score": "topk-softmax", "moe.router_bias": True, "moe.expert_bias": True, "moe.activation": "clamped-swiglu",
    "moe.shared_experts": 0, "moe.groups": 1, "moe.scale": 1.0,
    "moe.dense_layers": [],  # experts in every block: config.json has no way to say dense ones
}  # fmt: skip
_ROPE_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim",
    "attention_factor", "original_max_position_embeddings", "partial_rotary_factor",
}  # fmt: skip
# transformers' GptOssConfig when config.json leaves rope_parameters out.
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}  # fmt: skip
_KINDS = ("sliding_attention", "full_attention")


def settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    _refuse_quantized(hf, where)
    plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters", "rope_theta")}
    base = decoder_settings(plain, where, head_dim=64, eps=1e-5)
    layers = int(base["num_layers"])  # type: ignore[call-overload]  # read_int's value
    experts = read_int(hf, "num_local_experts", where, default=128)
    top_k = read_int(hf, "num_experts_per_tok", where, default=4)
    if top_k > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
    aux = read_number(hf, "router_aux_loss_coef", where, default=0.001, above=-1e-300)
    return {
        **SHAPE,
        **base,
        **_rope(hf, where),
        **_windows(hf, where, layers),
        "bias": read_bool(hf, "attention_bias", where, default=True),
        "moe.num_experts": experts,
        "moe.top_k": top_k,
        "moe.ffn_hidden": read_int(hf, "intermediate_size", where, default=2880),
        "moe.swiglu_alpha": read_number(hf, "swiglu_alpha", where, default=1.702, above=0.0),
        "moe.swiglu_limit": read_number(hf, "swiglu_limit", where, default=7.0, above=0.0),
        "moe.renormalize": False,
        # transformers adds the balancing loss only with output_router_logits: the loss it trains with.
        "moe.aux_loss_coef": aux if read_bool(hf, "output_router_logits", where, default=False) else 0.0,
    }


def _refuse_quantized(hf: Mapping[str, Any], where: str) -> None:
    """MXFP4 (OpenAI's released folders) is read, dequantized; any other quantization is refused."""
    quantization = hf.get("quantization_config")
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    if method == "mxfp4":
        return
    raise CheckpointError(
        f"{where}: quantization_config.quant_method={method!r} is not supported (polyshard dequantizes only "
        "gpt-oss's mxfp4 experts); save the model unquantized first, e.g. with transformers' "
        "AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16).save_pretrained(new_folder)"
    )


def _rope(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    """The rotary settings: YaRN (gpt-oss's) or none, read as transformers 5 reads them."""
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(name) or _DEFAULT_ROPE
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: {name}={params!r} must be an object of rotary parameters")
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise CheckpointError(f"{where}: {name} holds {unknown}, which polyshard does not read for gpt-oss")
    partial = {**hf, **params}.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise CheckpointError(
            f"{where}: partial_rotary_factor={partial!r} is not supported; polyshard rotates every dim"
        )
    theta = read_number({**hf, **params}, "rope_theta", where, default=150000.0, above=0.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope.theta": theta, "rope.factor": 1.0}
    if kind != "yarn":
        raise CheckpointError(
            f"{where}: {name}.rope_type={kind!r} is not supported; polyshard reads 'default' and 'yarn'"
        )
    return {"rope.theta": theta, **read_yarn(params, f"{where}: {name}")}


def _windows(hf: Mapping[str, Any], where: str, layers: int) -> dict[str, object]:
    """sliding_window and layer_types (default: sliding first, then full, in turn)."""
    window = read_int(hf, "sliding_window", where, default=0, low=0) or None
    kinds = hf.get("layer_types")
    if kinds is None:
        kinds = [_KINDS[i % 2] for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in _KINDS for k in kinds):
        raise CheckpointError(
            f"{where}: layer_types={kinds!r} must name each of the {layers} layers as one of {_KINDS}"
        )
    if window is None:
        if "sliding_attention" in kinds:
            raise CheckpointError(f"{where}: layer_types names sliding_attention layers but sliding_window is unset")
        return {"sliding_window": None, "layer_types": None}
    return {"sliding_window": window, "layer_types": kinds}


def differences(model: GptOssConfig) -> dict[str, object]:
    out = shape_differences(model, {**SHAPE, **({"rope.scaling": "yarn"} if model.rope.stretched else {})})
    if model.qkv_bias is not None and model.qkv_bias != model.bias:  # one attention_bias for q, k, v and o
        out["qkv_bias"] = model.bias
    return out


def locations(model: GptOssConfig) -> dict[str, TensorLocation]:
    def mlp(ours: str, hf: str) -> dict[str, TensorLocation]:
        out = {f"{ours}.attn.sinks": TensorLocation(f"{hf}.self_attn.sinks")}
        if model.bias:
            out[f"{ours}.attn.o_proj.bias"] = TensorLocation(f"{hf}.self_attn.o_proj.bias")
        names = {
            "router.weight": "router.weight",
            "router.logit_bias": "router.bias",
            "experts.w1": "experts.gate_up_proj",
            "experts.w1_bias": "experts.gate_up_proj_bias",
            "experts.w2": "experts.down_proj",
            "experts.w2_bias": "experts.down_proj_bias",
        }
        return out | {f"{ours}.mlp.moe.{p}": TensorLocation(f"{hf}.mlp.{n}") for p, n in names.items()}

    return decoder_locations(model, mlp)


def config(model: GptOssConfig) -> dict[str, object]:
    out = decoder_config_json(model)
    del out["rope_scaling"], out["rope_theta"]
    rope = yarn_parameters(model.rope)
    slides = model.sliding_window is not None
    kinds = model.layer_types or [_KINDS[0] if slides else _KINDS[1]] * model.num_layers
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **out,
        "rope_parameters": rope,
        "attention_bias": model.bias,
        "sliding_window": model.sliding_window,
        "layer_types": list(kinds),
        "num_local_experts": model.moe.num_experts,
        "num_experts_per_tok": model.moe.top_k,
        "intermediate_size": model.expert_width,
        "swiglu_alpha": model.moe.swiglu_alpha,
        "swiglu_limit": model.moe.swiglu_limit,
        "router_aux_loss_coef": model.moe.aux_loss_coef,
        "output_router_logits": model.moe.aux_loss_coef > 0,
    }


GPT_OSS = HFAdapter(
    model_type="gpt_oss",
    title="gpt-oss",
    settings=settings,
    differences=differences,
    locations=locations,
    config=config,
    base_prefix="model.",  # the base model's files: embed_tokens, layers, norm without "model."
    base_names=("embed_tokens.", "layers.", "norm."),
    at_most=frozenset({"context_length"}),  # rotary positions: any shorter sequence works
)
