"""Named sizes of the gpt-oss family (``model.preset``): OpenAI's two releases and a tiny one (the rotary
settings over the family's own, :func:`~polyshard.models.gpt_oss.config.gpt_oss_rope`)."""

from __future__ import annotations

from typing import Any


def _alternating(layers: int) -> list[str]:
    """gpt-oss's layer_types: sliding-window blocks first, then full, in turn."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _released(layers: int, experts: int) -> dict[str, Any]:
    return {
        "kind": "gpt-oss", "hidden": 2880, "num_layers": layers, "num_heads": 64, "num_kv_heads": 8,
        "head_dim": 64, "vocab_size": 201088, "context_length": 131072, "sliding_window": 128,
        "layer_types": _alternating(layers), "rope": {"factor": 32.0},
        "moe": {"num_experts": experts, "top_k": 4, "ffn_hidden": 2880},
    }  # fmt: skip


PRESETS: dict[str, dict[str, Any]] = {
    "gpt-oss-tiny": {
        "kind": "gpt-oss", "hidden": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "context_length": 64, "sliding_window": 16, "layer_types": _alternating(4),
        "rope": {"factor": 4.0, "original_context": 16}, "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden": 64},
    },
    "gpt-oss-20b": _released(24, 32),
    "gpt-oss-120b": _released(36, 128),
}  # fmt: skip
