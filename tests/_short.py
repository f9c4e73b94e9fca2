"""What the end-to-end parity tests share: the short training run (8 examples a step, 2 warmup steps, no
evaluation and no sample, so a run is its training steps alone) and the small Llama's architecture."""

from __future__ import annotations

from polyshard.models.gpt.presets import LLAMA


def short_run(
    steps: int, *, training: dict[str, object] | None = None, eval_every: int = 0, **optimizer: object
) -> dict[str, dict[str, object]]:
    """The sections of a ``steps``-step parity run, to splice into a config: ``[training]`` (8 examples a
    step; ``training`` adds or overrides keys), ``[optimizer]`` (``optimizer``'s keys), ``[lr_schedule]``
    (2 warmup steps) and ``[eval]`` (every ``eval_every`` steps, 0: none; no sample)."""
    return {
        "training": {"steps": steps, "global_batch_size": 8, **(training or {})},
        "optimizer": dict(optimizer),
        "lr_schedule": {"warmup_steps": 2},
        "eval": {"every": eval_every, "sample_tokens": 0},
    }


# Llama's architecture on the small parity GPT: the family's LLAMA fields (RMSNorm, SwiGLU, rotary
# positions, no biases), 2 kv heads (GQA) and an MLP width that is no multiple of the hidden.
SMALL_LLAMA: dict[str, object] = {**LLAMA, "num_kv_heads": 2, "mlp_hidden": 88}
