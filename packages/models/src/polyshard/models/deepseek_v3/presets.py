"""Named sizes of the DeepSeek family (``model.preset``): DeepSeek-V3 (671B, 37B active), DeepSeek-V2-Lite
(16B) and a tiny one that trains from scratch on a CPU in seconds."""

from __future__ import annotations

from typing import Any

_YARN = {"scaling": "yarn", "factor": 40.0, "original_context": 4096, "beta_fast": 32.0, "beta_slow": 1.0}

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3-tiny": {
        "kind": "deepseek-v3", "hidden": 64, "num_layers": 3, "num_heads": 4, "context_length": 64,
        "vocab_size": 256, "mlp_hidden": 128, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16,
        "moe": {"dense_layers": [0],
                "num_experts": 8, "top_k": 2, "ffn_hidden": 32, "score": "sigmoid", "groups": 2, "group_topk": 1,
                "scale": 2.5, "shared_experts": 1, "bias_update_rate": 0.001, "aux_loss_coef": 0.0,
                "seq_aux_loss_coef": 0.0001},
    },
    "deepseek-v3": {
        "kind": "deepseek-v3", "hidden": 7168, "num_layers": 61, "num_heads": 128, "context_length": 163840,
        "vocab_size": 129280, "mlp_hidden": 18432, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "rope": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        "moe": {"dense_layers": [0, 1, 2],
                "num_experts": 256, "top_k": 8, "ffn_hidden": 2048, "score": "sigmoid", "groups": 8, "group_topk": 4,
                "scale": 2.5, "shared_experts": 1, "bias_update_rate": 0.001, "aux_loss_coef": 0.0,
                "seq_aux_loss_coef": 0.0001},
    },
    "deepseek-v2-lite": {
        "kind": "deepseek-v3", "hidden": 2048, "num_layers": 27, "num_heads": 16, "context_length": 163840,
        "vocab_size": 102400, "mlp_hidden": 10944, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "rope": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        "moe": {"dense_layers": [0],
                "num_experts": 64, "top_k": 6, "ffn_hidden": 1408, "score": "softmax", "renormalize": False,
                "shared_experts": 2, "aux_loss_coef": 0.001},
    },
}  # fmt: skip
