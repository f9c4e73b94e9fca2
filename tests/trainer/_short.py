"""The short training run the end-to-end parity tests share: 8 examples a step, 2 warmup steps, no
evaluation and no sample, so a run is its training steps alone."""

from __future__ import annotations


def short_training(steps: int, **more: object) -> dict[str, object]:
    """``[training]`` for a ``steps``-step parity run; ``more`` adds or overrides keys."""
    return {"steps": steps, "global_batch_size": 8, "warmup_steps": 2, "eval_every": 0, "sample_tokens": 0, **more}
