"""The GPT's mixture-of-experts variant: every block's MLP is a polyshard.ep MoE layer.

A pipeline passes one activation tensor between stages, but an MoE layer
also produces an auxiliary (load-balancing) loss. :class:`MoEMLP` attaches
that loss to the activation with an autograd function whose backward feeds
the aux loss its gradient (``aux_loss_scale``, 1/microbatches) while passing
the activation's gradient through — so every stage's aux loss is trained
without a second output, as Megatron-LM's MoE aux-loss scaler does.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from polyshard.collectives import eager
from polyshard.mesh import divisors
from polyshard.models.common import MLP, SwiGLU
from polyshard.models.common.attach import AttachLoss
from polyshard.models.common.moe import MoEConfig, MoELayer
from polyshard.models.common.mtp import PredictionDepth
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.gpt import model as gpt
from polyshard.models.moe_gpt.config import MoEGPTConfig, moe_config
from polyshard.models.moe_gpt.hf import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from polyshard.models.moe_gpt.presets import PRESETS
from polyshard.models.spec import (
    BuildOptions,
    ModelSpec,
    ParallelSizes,
    attention_plan,
    check_mlp_split,
    mlp_plan,
    sequence_plan,
    split_sequence,
)
from polyshard.tp import SequenceParallel


class MoEMLP(nn.Module):
    """The routed experts (``moe``), plus with ``shared_hidden`` > 0 a dense SwiGLU every token passes
    through beside them (``shared_expert``: Qwen2-MoE's and DeepSeek's shared experts, one MLP as wide
    as all of them), whose output ``shared_gate`` scales per token by sigmoid(x . w) (Qwen2-MoE).
    Under tp the shared expert splits like the dense MLP; the routed experts are ep's.

    ``aux_loss_scale``: the aux loss's gradient; 1 / microbatches when a step accumulates several,
    as each microbatch's aux loss, like its cross-entropy, counts 1/m."""

    def __init__(
        self, config: MoEConfig, *, aux_loss_scale: float = 1.0, shared_hidden: int = 0, shared_gate: bool = False
    ):
        super().__init__()
        self.moe = MoELayer(config)
        self.shared_expert = SwiGLU(config.hidden, shared_hidden) if shared_hidden else None
        self.shared_expert_gate = nn.Linear(config.hidden, 1, bias=False) if shared_gate else None
        self.aux_loss_scale = aux_loss_scale
        self.last_aux_loss = 0.0

    @eager  # eager under training.compile: reads the aux loss as a float (and see MoELayer)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux = self.moe(x)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)  # (B, S, H), whole on every tp rank (row parallel's all-reduce)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared  # (B, S, 1) * (B, S, H)
            y = y + shared
        self.last_aux_loss = float(aux.detach())
        return (  # type: ignore[no-any-return]  # Function.apply and nn.Module.__call__ return Any
            AttachLoss.apply(y, aux, self.aux_loss_scale)  # type: ignore[no-untyped-call]
            if torch.is_grad_enabled()
            else y
        )


# -- the family's spec ----------------------------------------------------------------------------------


def build(config: ModelConfig, options: BuildOptions) -> gpt.GPT:
    """The GPT (or Llama) with every block's MLP an MoE layer of SwiGLU experts (Mixtral's, DeepSeek's),
    with shared experts beside them when ``model.moe.shared_experts`` > 0 (Qwen2-MoE's, DeepSeek's);
    the blocks in ``model.moe.dense_layers`` keep a dense MLP ``model.moe.dense_ffn_hidden`` wide."""
    config = moe_config(config)
    model = gpt.build(config, options)
    layer = config.layer()  # experts by default about a dense MLP's active FLOPs wide
    head = cast(gpt.LMHead, model.layers[-1])
    mtp: list[nn.Module] = list(head.mtp.depths) if head.mtp is not None else []
    depths = [cast(PredictionDepth, depth).block for depth in mtp]  # DeepSeek-V3's depths are MoE blocks too
    for i, block in enumerate([*model.layers[1:-1], *depths]):
        if i < config.num_layers and not config.sparse_layer(i):
            if config.dense_width != config.mlp_width:
                dense = MLP if config.activation == "gelu" else SwiGLU
                block.mlp = dense(config.hidden, config.dense_width, bias=config.bias)
            continue
        block.mlp = MoEMLP(
            layer,
            aux_loss_scale=options.aux_loss_scale,
            shared_hidden=config.shared_width,
            shared_gate=config.moe.shared_gate,
        )
    return model


def routing_summary(model: ModelConfig) -> str:
    """One line saying how tokens choose their experts, for ``--dry-run``."""
    config = moe_config(model)
    moe = config.moe
    parts = [f"{moe.score} top-{moe.top_k} of {moe.num_experts} experts"]
    if moe.dense_layers:
        parts.append(f"blocks {sorted(moe.dense_layers)} dense (MLP {config.dense_width} wide)")
    if moe.groups > 1:
        parts.append(f"within the best {moe.group_topk} of {moe.groups} groups")
    if moe.score == "sigmoid":
        parts.append(f"selection bias moved {moe.bias_update_rate:g} a step by the global load")
    if moe.scale != 1.0:
        parts.append(f"weights x {moe.scale:g}")
    losses = {"switch": moe.aux_loss_coef, "sequence-wise": moe.seq_aux_loss_coef, "z": moe.z_loss_coef}
    weighted = [f"{name} {weight:g}" for name, weight in losses.items() if weight > 0]
    parts.append("balance losses: " + (", ".join(weighted) if weighted else "none"))
    return "routing: " + "; ".join(parts)


def tp_plan(model: ModelConfig, parallel: ParallelSizes) -> dict[str, object]:
    """Attention and vocabulary as the GPT's; the routed experts are not split by tp (ep splits them),
    the shared experts are, like the dense MLP (their gate's one vector is replicated), and so are the
    dense blocks' MLPs. Under sequence parallelism the routed experts run on each tp rank's sequence
    shard (the trainer sums their gradients over tp: polyshard.trainer.engine.builder), and so does the
    shared gate (flagged like a norm)."""
    model = moe_config(model)
    plan: dict[str, object] = {}
    for i in range(1, model.num_layers + 1):
        plan |= attention_plan(f"layers.{i}", model, parallel, qk_norm=model.qk_norm, sinks=model.attention_sinks)
        plan |= sequence_plan(f"layers.{i}", parallel.sequence_parallel)  # the norms on a sequence shard
        if not model.sparse_layer(i - 1):
            plan |= mlp_plan(f"layers.{i}", parallel.sequence_parallel, model.activation)
        elif model.moe.shared_experts:
            plan |= mlp_plan(f"layers.{i}", parallel.sequence_parallel, "swiglu", mlp="mlp.shared_expert")
            if model.moe.shared_gate and parallel.sequence_parallel:  # replicated, on this rank's sequence shard
                plan[f"layers.{i}.mlp.shared_expert_gate"] = SequenceParallel()
    plan |= gpt.mtp_plan(model, parallel, mlp=False)  # the depths' attention; their experts are ep's
    for k in range(model.mtp_depth if model.moe.shared_experts else 0):
        plan |= mlp_plan(
            f"layers.{model.num_layers + 1}.mtp.depths.{k}.block", False, "swiglu", mlp="mlp.shared_expert"
        )
    return plan | split_sequence(1, parallel.sequence_parallel) | gpt.vocab_plan(model, parallel)


def check(model: ModelConfig, parallel: ParallelSizes) -> None:
    model, par = moe_config(model), parallel
    if par.ep > 1 and par.zero_stage == 3:
        # ZeRO-3 shards every parameter of a stage over dp x ep, but each ep rank holds different experts.
        raise ConfigError(
            f"parallel.zero_stage=3 with parallel.ep={par.ep} is not supported (experts differ between ep ranks "
            "and cannot be sharded over them); use zero_stage 0-2 with experts, or ep=1"
        )
    gpt.check_mtp(model, parallel)
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


SPEC = ModelSpec(
    kind="moe-gpt",
    config=MoEGPTConfig,
    presets=PRESETS,
    sequence_length=gpt.sequence_length,
    output_width=gpt.vocab_size,
    task="language",
    build=build,
    tp_plan=tp_plan,
    has_experts=True,
    tied=gpt.tied,
    check=check,
    context_parallel=True,  # each cp rank routes its chunks; aux losses, capacity over the cp group (ep.token_group)
    hf_families=(MIXTRAL, QWEN3_MOE, QWEN2_MOE),
)
