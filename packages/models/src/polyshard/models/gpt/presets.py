"""Named sizes of the GPT family (``model.preset``): GPT-2's, Llama's and Qwen's."""

from __future__ import annotations

from typing import Any

# Llama's architecture on the GPT: RMSNorm, SwiGLU, rotary positions, no biases.
LLAMA: dict[str, Any] = {"norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"hidden": 64, "num_layers": 4, "num_heads": 4, "context_length": 64},
    "small": {"hidden": 256, "num_layers": 6, "num_heads": 8, "context_length": 256},
    "gpt2-124m": {"hidden": 768, "num_layers": 12, "num_heads": 12, "context_length": 1024, "vocab_size": 50257},
    "llama-tiny": {
        **LLAMA, "hidden": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "context_length": 64,
        "mlp_hidden": 176,
    },
    "llama-3.2-1b": {
        **LLAMA, "hidden": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "context_length": 8192,
        "mlp_hidden": 8192, "vocab_size": 128256, "tie_embeddings": True, "norm_eps": 1e-5,
        "rope": {"theta": 500000.0, "scaling": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_context": 8192},
    },
    "llama-3-8b": {
        **LLAMA, "hidden": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "context_length": 8192,
        "mlp_hidden": 14336, "vocab_size": 128256, "rope": {"theta": 500000.0}, "norm_eps": 1e-5,
    },
    # Qwen3: Llama's architecture with q/k norms and 128-dim heads at every width.
    "qwen3-tiny": {
        **LLAMA, "qk_norm": True, "hidden": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
        "context_length": 64, "mlp_hidden": 176, "norm_eps": 1e-6, "tie_embeddings": True,
    },
    "qwen3-8b": {
        **LLAMA, "qk_norm": True, "hidden": 4096, "num_layers": 36, "num_heads": 32, "num_kv_heads": 8,
        "head_dim": 128, "context_length": 40960, "mlp_hidden": 12288, "vocab_size": 151936, "rope": {"theta": 1e6},
        "norm_eps": 1e-6,
    },
}  # fmt: skip
