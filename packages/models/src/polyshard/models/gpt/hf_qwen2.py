"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): Llama's architecture with biases on the q, k and v
projections only (``model.qkv_bias = true``; none on o or the MLP). The names are Llama's, the biases
``self_attn.{q,k,v}_proj.bias``; nothing is transposed or permuted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyshard.checkpoint import TensorLocation
from polyshard.models.gpt.config import GPTConfig
from polyshard.models.gpt.hf_llama import (
    decoder_config_json,
    decoder_family,
    decoder_locations,
    decoder_settings,
    dense_mlp,
)
from polyshard.models.gpt.hf_qwen3 import check_full_attention
from polyshard.models.gpt.presets import LLAMA
from polyshard.models.hf_adapter import FULL_ATTENTION, read_int

SHAPE: dict[str, object] = {"kind": "gpt", **LLAMA, "qkv_bias": True, "qk_norm": False, **FULL_ATTENTION}


def settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    """``config.json`` -> polyshard's ``[model]`` settings; whatever polyshard cannot compute is refused."""
    check_full_attention(hf, where)
    return {**SHAPE, **decoder_settings(hf, where), "mlp_hidden": read_int(hf, "intermediate_size", where)}


def locations(model: GPTConfig) -> dict[str, TensorLocation]:
    return decoder_locations(model, dense_mlp)


def config(model: GPTConfig) -> dict[str, object]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **decoder_config_json(model),
        "intermediate_size": model.mlp_width,
        "use_sliding_window": False,
    }


QWEN2 = decoder_family("qwen2", "Qwen2", SHAPE, settings, locations, config)
