"""Qwen3 (``Qwen3ForCausalLM``): Llama's architecture plus an RMSNorm over each head's q and k before
rotary positions (``self_attn.q_norm`` / ``k_norm``, one weight entry per head dim), and a head dim of
its own (128 at every width: Qwen3-4B's 32 heads of 128 on a 2,560-wide stream). The names are
Llama's; nothing is transposed or permuted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyshard.checkpoint import CheckpointError, TensorLocation
from polyshard.models.gpt.config import GPTConfig
from polyshard.models.gpt.hf_llama import (
    decoder_config_json,
    decoder_family,
    decoder_locations,
    decoder_settings,
    dense_mlp,
)
from polyshard.models.gpt.presets import LLAMA
from polyshard.models.hf_adapter import FULL_ATTENTION, read_bool, read_int, require

SHAPE: dict[str, object] = {"kind": "gpt", **LLAMA, "qkv_bias": False, "qk_norm": True, **FULL_ATTENTION}
QWEN3_HEAD_DIM = 128  # Qwen3Config's default head_dim, used when config.json has none


def check_full_attention(hf: Mapping[str, Any], where: str) -> None:
    """Qwen's configs may turn on sliding-window attention for some layers; polyshard attends to the
    whole causal context, so only folders that keep it off (every released Qwen3) are read."""
    if read_bool(hf, "use_sliding_window", where, default=False):
        raise CheckpointError(
            f"{where}: use_sliding_window=true is not supported (polyshard's attention sees the whole "
            "context); polyshard reads false"
        )
    kinds = hf.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or any(k != "full_attention" for k in kinds)):
        raise CheckpointError(
            f"{where}: layer_types={kinds!r} is not supported; polyshard reads only 'full_attention' layers"
        )


def settings(hf: Mapping[str, Any], where: str) -> dict[str, object]:
    """``config.json`` -> polyshard's ``[model]`` settings; whatever polyshard cannot compute is refused."""
    require(hf, "attention_bias", where, (False,), "Qwen3's projections have no biases")
    check_full_attention(hf, where)
    return {
        **SHAPE,
        **decoder_settings(hf, where, head_dim=QWEN3_HEAD_DIM),
        "mlp_hidden": read_int(hf, "intermediate_size", where),
    }


def locations(model: GPTConfig) -> dict[str, TensorLocation]:
    return decoder_locations(model, dense_mlp)


def config(model: GPTConfig) -> dict[str, object]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **decoder_config_json(model),
        "intermediate_size": model.mlp_width,
        "attention_bias": False,
        "use_sliding_window": False,
    }


QWEN3 = decoder_family("qwen3", "Qwen3", SHAPE, settings, locations, config)
