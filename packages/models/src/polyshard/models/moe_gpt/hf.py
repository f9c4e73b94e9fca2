"""Mixtral, Qwen3-MoE and Qwen2-MoE: Llama-like decoders whose MLPs are polyshard's MoE layers.

Attention and norms have Llama's names (Qwen3-MoE adds q/k norms, Qwen2-MoE q/k/v biases; see
:mod:`polyshard.models.gpt.hf_llama`). The files keep one ``Linear`` per expert, as the Hub's
checkpoints do (transformers 5 fuses them into 3-D tensors in memory and splits them again when it
saves); polyshard stacks them, each transposed, into one tensor per weight:

=====================================  ======================================================  ==========
polyshard (``layers.<i>.mlp``)         Hugging Face (``model.layers.<i-1>``)                   layout
=====================================  ======================================================  ==========
``moe.router.weight`` (E, H)           Mixtral ``block_sparse_moe.gate``; Qwen ``mlp.gate``    same
``moe.experts.w1`` (E, H, F)           ``…experts.<e>.w1`` / ``mlp.experts.<e>.gate_proj``     stacked, T
``moe.experts.w3`` (E, H, F)           ``…experts.<e>.w3`` / ``mlp.experts.<e>.up_proj``       stacked, T
``moe.experts.w2`` (E, F, H)           ``…experts.<e>.w2`` / ``mlp.experts.<e>.down_proj``     stacked, T
``shared_expert.{gate,up,down}_proj``  ``mlp.shared_expert.{gate,up,down}_proj`` (Qwen2-MoE)   same
``shared_expert_gate.weight`` (1, H)   ``mlp.shared_expert_gate.weight`` (Qwen2-MoE)           same
=====================================  ======================================================  ==========

Qwen-MoE's dense blocks (``mlp_only_layers``, and the blocks ``decoder_sparse_step`` skips) are our
``model.moe.dense_layers``, their SwiGLU ``intermediate_size`` wide (``model.moe.dense_ffn_hidden``),
named as Llama's MLP (``mlp.{gate,up,down}_proj``); export writes them as ``mlp_only_layers`` with
``decoder_sparse_step`` 1. An ep rank reads only its own experts' tensors. Routing is each family's
softmax top-k: Mixtral always renormalises the k weights, Qwen as ``norm_topk_prob`` says
(``model.moe.renormalize``). Refused, naming the key: sliding-window attention, router jitter noise,
another activation, and biases polyshard does not have.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from polyshard.checkpoint import CheckpointError, TensorLocation
from polyshard.models.gpt.hf_llama import (
    decoder_config_json,
    decoder_family,
    decoder_locations,
    decoder_settings,
    dense_mlp,
)
from polyshard.models.gpt.hf_qwen3 import check_full_attention
from polyshard.models.gpt.presets import LLAMA
from polyshard.models.hf_adapter import FULL_ATTENTION, read_bool, read_int, read_number, require
from polyshard.models.moe_gpt.config import MoEGPTConfig

# Softmax top-k over every expert: what these families compute (a sigmoid router with a selection bias,
# DeepSeek's, or group-limited routing would need other files and are refused on export).
_BASE = {"kind": "moe-gpt", **LLAMA, "moe.score": "softmax", "moe.groups": 1, "moe.scale": 1.0, **FULL_ATTENTION}
MIXTRAL_SHAPE: dict[str, object] = {
    **_BASE, "qkv_bias": False, "qk_norm": False, "moe.shared_experts": 0, "moe.renormalize": True,
    "moe.dense_layers": [],  # Mixtral has experts in every block
}  # fmt: skip
QWEN3_MOE_SHAPE: dict[str, object] = {**_BASE, "qkv_bias": False, "qk_norm": True, "moe.shared_experts": 0}
# bias=False (from Llama's) is o_proj's and the MLPs'; q, k and v have biases as qkv_bias says.
QWEN2_MOE_SHAPE: dict[str, object] = {**_BASE, "qk_norm": False, "moe.shared_experts": 1, "moe.shared_gate": True}
# What these families' experts are, beyond the settings a folder gives (a model differing is exported as none).
_PLAIN = {"moe.activation": "swiglu", "moe.router_bias": False, "moe.expert_bias": False}


def _experts(model: MoEGPTConfig, prefix: str, names: Mapping[str, str]) -> dict[str, TensorLocation]:
    """Our stacked experts of one block, ``layers.<i>.mlp.moe.experts.<w>``, from the per-expert
    ``<prefix>.<e>.<names[w]>.weight`` (each a Linear weight: ours transposed)."""
    return {
        w: TensorLocation(
            f"{prefix}.0.{hf}.weight",
            transposed=True,
            stacked=tuple(f"{prefix}.{e}.{hf}.weight" for e in range(model.moe.num_experts)),
        )
        for w, hf in names.items()
    }


def _moe_mlp(
    model: MoEGPTConfig, block: str, router: str, experts: str, names: Mapping[str, str]
) -> Callable[[str, str], dict[str, TensorLocation]]:
    """Where one block's MoE MLP lives: the router ``<block>.<router>``, the experts ``<block>.<experts>.<e>``
    (their weights named by ``names``), and Qwen2-MoE's shared expert and its gate."""

    def mlp(ours: str, hf: str) -> dict[str, TensorLocation]:
        if not model.sparse_layer(int(ours.removeprefix("layers.")) - 1):  # our layers.<i> is block i-1
            return dense_mlp(ours, hf)
        out = {f"{ours}.mlp.moe.router.weight": TensorLocation(f"{hf}.{block}.{router}.weight")}
        for w, location in _experts(model, f"{hf}.{block}.{experts}", names).items():
            out[f"{ours}.mlp.moe.experts.{w}"] = location
        if model.moe.shared_experts:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"mlp.shared_expert.{proj}.weight"
                out[f"{ours}.{name}"] = TensorLocation(f"{hf}.{name}")
        if model.moe.shared_gate:
            out[f"{ours}.mlp.shared_expert_gate.weight"] = TensorLocation(f"{hf}.mlp.shared_expert_gate.weight")
        return out

    return mlp


_QWEN_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _routing(hf: Mapping[str, Any], where: str, experts_key: str, experts: int, top_k: int) -> dict[str, object]:
    num_experts = read_int(hf, experts_key, where, default=experts)
    k = read_int(hf, "num_experts_per_tok", where, default=top_k)
    if k > num_experts:
        raise CheckpointError(f"{where}: num_experts_per_tok={k} exceeds {experts_key}={num_experts}")
    return {"moe.num_experts": num_experts, "moe.top_k": k}


# -- Mixtral ---------------------------------------------------------------------------------------------


def mixtral_settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    noise = read_number(hf, "router_jitter_noise", where, default=0.0, above=-1.0)
    if noise != 0.0:
        raise CheckpointError(
            f"{where}: router_jitter_noise={noise} is not supported (polyshard's router adds no noise); "
            "polyshard reads 0"
        )
    window = hf.get("sliding_window")
    if window is not None:
        raise CheckpointError(
            f"{where}: sliding_window={window!r} is not supported (polyshard's attention sees the whole context); "
            "polyshard reads null"
        )
    return {
        **MIXTRAL_SHAPE,
        **decoder_settings(hf, where, theta=1e6, eps=1e-5),  # MixtralConfig's default base and epsilon
        **_routing(hf, where, "num_local_experts", 8, 2),
        "moe.ffn_hidden": read_int(hf, "intermediate_size", where),
    }


def mixtral_locations(model: MoEGPTConfig) -> dict[str, TensorLocation]:
    names = {"w1": "w1", "w2": "w2", "w3": "w3"}
    return decoder_locations(model, _moe_mlp(model, "block_sparse_moe", "gate", "experts", names))


def mixtral_config(model: MoEGPTConfig) -> dict[str, object]:
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **decoder_config_json(model),
        "intermediate_size": model.expert_width,
        "num_local_experts": model.moe.num_experts,
        "num_experts_per_tok": model.moe.top_k,
        "router_aux_loss_coef": model.moe.aux_loss_coef,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


MIXTRAL = decoder_family(
    "mixtral", "Mixtral", {**MIXTRAL_SHAPE, **_PLAIN}, mixtral_settings, mixtral_locations, mixtral_config
)


# -- Qwen3-MoE and Qwen2-MoE ---------------------------------------------------------------------------


def _dense_layers(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    """Qwen-MoE's dense blocks: block i keeps its MLP when it is in ``mlp_only_layers`` or when
    ``decoder_sparse_step`` does not divide i + 1 (transformers' rule); those MLPs are ``intermediate_size``
    wide. Nothing when every block is sparse (the dense width is then unused)."""
    layers = read_int(hf, "num_hidden_layers", where)
    step = read_int(hf, "decoder_sparse_step", where, default=1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise CheckpointError(f"{where}: mlp_only_layers={only!r} must be a list of block indices")
    outside = [i for i in only if not 0 <= i < layers]
    if outside:
        raise CheckpointError(
            f"{where}: mlp_only_layers={only!r} names blocks {outside} outside 0..{layers - 1} (num_hidden_layers)"
        )
    dense = [i for i in range(layers) if i in only or (i + 1) % step]
    if not dense:
        return {}
    return {"moe.dense_layers": dense, "moe.dense_ffn_hidden": read_int(hf, "intermediate_size", where)}


def qwen3_moe_settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    require(hf, "attention_bias", where, (False,), "Qwen3's projections have no biases")
    check_full_attention(hf, where)
    # transformers 5 writes num_local_experts, 4 (and the Hub's files) num_experts.
    key = "num_local_experts" if hf.get("num_local_experts") is not None else "num_experts"
    return {
        **QWEN3_MOE_SHAPE,
        **decoder_settings(hf, where),
        **_routing(hf, where, key, 128, 8),
        "moe.ffn_hidden": read_int(hf, "moe_intermediate_size", where, default=768),
        "moe.renormalize": read_bool(hf, "norm_topk_prob", where, default=False),
        **_dense_layers(hf, where),
    }


def qwen2_moe_settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    check_full_attention(hf, where)
    return {
        **QWEN2_MOE_SHAPE,
        **decoder_settings(hf, where),
        **_routing(hf, where, "num_experts", 60, 4),
        "qkv_bias": read_bool(hf, "qkv_bias", where, default=True),
        "moe.ffn_hidden": read_int(hf, "moe_intermediate_size", where, default=1408),
        "moe.shared_ffn_hidden": read_int(hf, "shared_expert_intermediate_size", where, default=5632),
        "moe.renormalize": read_bool(hf, "norm_topk_prob", where, default=False),
        **_dense_layers(hf, where),
    }


def qwen_moe_locations(model: MoEGPTConfig) -> dict[str, TensorLocation]:
    return decoder_locations(model, _moe_mlp(model, "mlp", "gate", "experts", _QWEN_EXPERTS))


def _qwen_moe_config(model: MoEGPTConfig) -> dict[str, object]:
    return {
        **decoder_config_json(model),
        "intermediate_size": model.dense_width,  # the dense blocks' MLP width
        "moe_intermediate_size": model.expert_width,
        "num_experts_per_tok": model.moe.top_k,
        "norm_topk_prob": model.moe.renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": sorted(model.moe.dense_layers),
        "router_aux_loss_coef": model.moe.aux_loss_coef,
        "use_sliding_window": False,
    }


def qwen3_moe_config(model: MoEGPTConfig) -> dict[str, object]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_qwen_moe_config(model),
        "num_experts": model.moe.num_experts,
        "attention_bias": False,
    }


def qwen2_moe_config(model: MoEGPTConfig) -> dict[str, object]:
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        **_qwen_moe_config(model),
        "num_experts": model.moe.num_experts,
        "shared_expert_intermediate_size": model.shared_width,
        "qkv_bias": model.qkv_biased,
    }


QWEN3_MOE = decoder_family(
    "qwen3_moe", "Qwen3-MoE", {**QWEN3_MOE_SHAPE, **_PLAIN}, qwen3_moe_settings, qwen_moe_locations, qwen3_moe_config
)

QWEN2_MOE = decoder_family(
    "qwen2_moe", "Qwen2-MoE", {**QWEN2_MOE_SHAPE, **_PLAIN}, qwen2_moe_settings, qwen_moe_locations, qwen2_moe_config
)
