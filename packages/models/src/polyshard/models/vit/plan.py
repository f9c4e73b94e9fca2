"""How the ViT splits over tp: heads and MLP columns in each block (the patch embedding and the
classifier replicated); and the layouts it cannot run."""

from __future__ import annotations

from polyshard.models.config import ModelConfig
from polyshard.models.spec import (
    ParallelSizes,
    attention_plan,
    check_mlp_split,
    mlp_plan,
    sequence_plan,
    split_sequence,
)


def tp_plan(model: ModelConfig, parallel: ParallelSizes) -> dict[str, object]:
    """The blocks as the GPT's; the patch embedding and the small classifier head stay replicated."""
    plan: dict[str, object] = {}
    sp = parallel.sequence_parallel
    for i in range(1, model.num_layers + 1):
        block = f"layers.{i}"
        plan |= attention_plan(block, model, parallel) | mlp_plan(block, sp, "gelu") | sequence_plan(block, sp)
    return plan | split_sequence(1, sp)


def check(model: ModelConfig, parallel: ParallelSizes) -> None:
    check_mlp_split(model.mlp_ratio * model.hidden, parallel.tp)  # the ViT's MLP
