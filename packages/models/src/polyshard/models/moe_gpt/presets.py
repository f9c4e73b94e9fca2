"""Named sizes of the MoE GPT family (``model.preset``): Mixtral's and Qwen-MoE's."""

from __future__ import annotations

from typing import Any

from polyshard.models.gpt.presets import LLAMA

PRESETS: dict[str, dict[str, Any]] = {
    "mixtral-tiny": {
        **LLAMA, "kind": "moe-gpt", "hidden": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
        "context_length": 64, "rope": {"theta": 1e6}, "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden": 96},
    },
    "mixtral-8x7b": {
        **LLAMA, "kind": "moe-gpt", "hidden": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
        "context_length": 32768, "vocab_size": 32000, "rope": {"theta": 1e6},
        "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden": 14336},
    },
    "qwen3-moe-tiny": {
        **LLAMA, "kind": "moe-gpt", "qk_norm": True, "hidden": 64, "num_layers": 4, "num_heads": 4,
        "num_kv_heads": 2, "context_length": 64, "norm_eps": 1e-6,
        "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden": 32},
    },
    "qwen3-30b-a3b": {
        **LLAMA, "kind": "moe-gpt", "qk_norm": True, "hidden": 2048, "num_layers": 48, "num_heads": 32,
        "num_kv_heads": 4, "head_dim": 128, "context_length": 40960, "vocab_size": 151936, "rope": {"theta": 1e6},
        "norm_eps": 1e-6, "moe": {"num_experts": 128, "top_k": 8, "ffn_hidden": 768},
    },
    "qwen2-moe-tiny": {
        **LLAMA, "kind": "moe-gpt", "qkv_bias": True, "hidden": 64, "num_layers": 4, "num_heads": 4,
        "context_length": 64, "norm_eps": 1e-6,
        "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden": 32, "shared_experts": 1, "shared_ffn_hidden": 128,
                "shared_gate": True, "renormalize": False},
    },
}  # fmt: skip
