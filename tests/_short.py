"""What the end-to-end parity tests share: the short training run (8 examples a step, 2 warmup steps, no
evaluation and no sample, so a run is its training steps alone) and the small Llama's architecture."""

from __future__ import annotations

from polyshard.models.gpt.presets import LLAMA


def short_training(steps: int, **more: object) -> dict[str, object]:
    """``[training]`` for a ``steps``-step parity run; ``more`` adds or overrides keys."""
    return {"steps": steps, "global_batch_size": 8, "warmup_steps": 2, "eval_every": 0, "sample_tokens": 0, **more}


# Llama's architecture on the small parity GPT: the family's LLAMA fields (RMSNorm, SwiGLU, rotary
# positions, no biases), 2 kv heads (GQA) and an MLP width that is no multiple of the hidden.
SMALL_LLAMA: dict[str, object] = {**LLAMA, "num_kv_heads": 2, "mlp_hidden": 88}
