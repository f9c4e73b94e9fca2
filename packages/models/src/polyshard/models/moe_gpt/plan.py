"""How the MoE GPT splits: the GPT's attention and vocabulary plans, shared experts' columns over tp,
the routed experts left to ep; and the layouts it cannot run."""

from __future__ import annotations

from polyshard.mesh import divisors
from polyshard.models.config import ModelConfig
from polyshard.models.decoder import grouped_attention, moe_config
from polyshard.models.errors import ConfigError
from polyshard.models.gpt import plan as gpt_plan
from polyshard.models.spec import (
    ParallelSizes,
    attention_plan,
    check_mlp_split,
    mlp_plan,
    sequence_plan,
    split_sequence,
)
from polyshard.tp import SequenceParallel


def tp_plan(model: ModelConfig, parallel: ParallelSizes) -> dict[str, object]:
    """Attention and vocabulary as the GPT's; the routed experts are not split by tp (ep splits them),
    the shared experts are, like the dense MLP (their gate's one vector is replicated), and so are the
    dense blocks' MLPs. Under sequence parallelism the routed experts run on each tp rank's sequence
    shard (the trainer sums their gradients over tp: polyshard.trainer.engine.builder), and so does the
    shared gate (flagged like a norm)."""
    attention, model = grouped_attention(model), moe_config(model)
    plan: dict[str, object] = {}
    for i in range(1, model.num_layers + 1):
        plan |= attention_plan(
            f"layers.{i}", model, parallel, qk_norm=attention.qk_norm, sinks=attention.attention_sinks
        )
        plan |= sequence_plan(f"layers.{i}", parallel.sequence_parallel)  # the norms on a sequence shard
        if not model.sparse_layer(i - 1):
            plan |= mlp_plan(f"layers.{i}", parallel.sequence_parallel, model.activation)
        elif model.moe.shared_experts:
            plan |= mlp_plan(f"layers.{i}", parallel.sequence_parallel, "swiglu", mlp="mlp.shared_expert")
            if model.moe.shared_gate and parallel.sequence_parallel:  # replicated, on this rank's sequence shard
                plan[f"layers.{i}.mlp.shared_expert_gate"] = SequenceParallel()
    plan |= gpt_plan.mtp_plan(model, parallel, mlp=False)  # the depths' attention; their experts are ep's
    for k in range(model.mtp_depth if model.moe.shared_experts else 0):
        plan |= mlp_plan(
            f"layers.{model.num_layers + 1}.mtp.depths.{k}.block", False, "swiglu", mlp="mlp.shared_expert"
        )
    return plan | split_sequence(1, parallel.sequence_parallel) | gpt_plan.vocab_plan(model, parallel)


def check(model: ModelConfig, parallel: ParallelSizes) -> None:
    model, par = moe_config(model), parallel
    if par.ep > 1 and par.zero_stage == 3:
        # ZeRO-3 shards every parameter of a stage over dp x ep, but each ep rank holds different experts.
        raise ConfigError(
            f"parallel.zero_stage=3 with parallel.ep={par.ep} is not supported (experts differ between ep ranks "
            "and cannot be sharded over them); use zero_stage 0-2 with experts, or ep=1"
        )
    gpt_plan.check_mtp(model, parallel)
    if model.mtp_depth > 1:
        raise ConfigError(
            f"model.mtp_depth={model.mtp_depth} with model.kind={model.kind!r} is not supported: each depth's block "
            "is an MoE layer and the head's pipeline layer holds at most one (the experts' load is kept per "
            "layer); use mtp_depth = 1, as DeepSeek-V3 does"
        )
    if model.moe.shared_experts:
        check_mlp_split(model.shared_width, par.tp)
    if model.moe.dense_layers:
        check_mlp_split(model.dense_width, par.tp)
    experts = model.moe.num_experts
    if experts % par.ep:
        raise ConfigError(
            f"parallel.ep={par.ep} does not divide model.moe.num_experts={experts}; choose ep in {divisors(experts)}"
        )
