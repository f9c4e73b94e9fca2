"""How the GPT splits over the parallel axes: tensor parallelism's plan (Megatron-LM's: heads and MLP
columns in each block, the vocabulary at both ends, sequence-parallel norms), the prediction depths',
and the layouts it cannot run."""

from __future__ import annotations

from polyshard.models.config import ModelConfig
from polyshard.models.decoder import decoder_config, grouped_attention
from polyshard.models.errors import ConfigError
from polyshard.models.spec import (
    ParallelSizes,
    attention_plan,
    check_mlp_split,
    mlp_plan,
    sequence_plan,
    split_sequence,
)
from polyshard.tp import SequenceParallel, VocabParallel


def vocab_plan(model: ModelConfig, parallel: ParallelSizes) -> dict[str, object]:
    """The embedding and the output head split along the vocabulary (the loss is vocabulary-parallel)."""
    model = decoder_config(model)
    last, sp = model.num_layers + 1, parallel.sequence_parallel
    plan: dict[str, object] = {"layers.0.tok": VocabParallel()}
    plan[f"layers.{last}.proj"] = VocabParallel(sequence_parallel=sp)
    if model.mtp_depth:
        plan[f"layers.{last}.mtp.embed"] = VocabParallel()
    if sp:
        plan[f"layers.{last}.norm"] = SequenceParallel()
    return plan


def tp_plan(model: ModelConfig, parallel: ParallelSizes) -> dict[str, object]:
    """Megatron-LM's plan: heads and MLP columns split in each block, the vocabulary at both ends."""
    model = grouped_attention(model)
    plan: dict[str, object] = {}
    sp = parallel.sequence_parallel
    for i in range(1, model.num_layers + 1):
        block = f"layers.{i}"
        plan |= attention_plan(block, model, parallel, qk_norm=model.qk_norm, sinks=model.attention_sinks) | mlp_plan(
            block, sp, model.activation
        )
        plan |= sequence_plan(block, sp)
    return plan | split_sequence(1, sp) | vocab_plan(model, parallel) | mtp_plan(model, parallel)


def mtp_plan(model: ModelConfig, parallel: ParallelSizes, mlp: bool = True) -> dict[str, object]:
    """Each prediction depth's block splits like the model's blocks (heads and MLP columns over tp); its
    norms and its (2H -> H) combination are replicated, and run on whole sequences (no SP inside)."""
    config, plan = grouped_attention(model), dict[str, object]()
    for k in range(config.mtp_depth):
        block = f"layers.{model.num_layers + 1}.mtp.depths.{k}.block"
        plan |= attention_plan(block, config, parallel, qk_norm=config.qk_norm, sinks=config.attention_sinks)
        if mlp:
            plan |= mlp_plan(block, False, config.activation)
    return plan


def check(model: ModelConfig, parallel: ParallelSizes) -> None:
    check_mlp_split(model.mlp_width, parallel.tp)
    check_mtp(model, parallel)


def check_mtp(model: ModelConfig, parallel: ParallelSizes) -> None:
    """What multi-token prediction does not run with."""
    if decoder_config(model).mtp_depth and parallel.sequence_parallel:
        raise ConfigError(
            f"model.mtp_depth={decoder_config(model).mtp_depth} with parallel.sequence_parallel is not supported "
            "(the prediction depths run on whole sequences); turn sequence_parallel off or set mtp_depth = 0"
        )
