"""The GPT's mixture-of-experts variant: every block's MLP is a polyshard.ep MoE layer.

A pipeline passes one activation tensor between stages, but an MoE layer
also produces an auxiliary (load-balancing) loss. :class:`MoEMLP` attaches
that loss to the activation with an autograd function whose backward feeds
the aux loss its gradient (``aux_loss_scale``, 1/microbatches) while passing
the activation's gradient through — so every stage's aux loss is trained
without a second output, as Megatron-LM's MoE aux-loss scaler does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from polyshard.collectives import eager
from polyshard.ep import MoEConfig, MoELayer
from polyshard.mesh import divisors
from polyshard.models.common import SwiGLU
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.gpt import model as gpt
from polyshard.models.moe_gpt.hf import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from polyshard.models.spec import (
    BuildOptions,
    ModelSpec,
    ParallelSizes,
    attention_plan,
    check_mlp_split,
    mlp_plan,
    split_sequence,
)


class _AttachAuxLoss(torch.autograd.Function):
    """forward: identity on ``x`` / backward: ``x``'s gradient, and ``scale`` as the aux loss's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.scale, device=grad.device), None


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
            _AttachAuxLoss.apply(y, aux, self.aux_loss_scale)  # type: ignore[no-untyped-call]
            if torch.is_grad_enabled()
            else y
        )


# -- the family's spec ----------------------------------------------------------------------------------


def build(config: ModelConfig, options: BuildOptions) -> gpt.GPT:
    """The GPT (or Llama) with every block's MLP an MoE layer of SwiGLU experts (Mixtral's, DeepSeek's),
    with shared experts beside them when ``model.shared_experts`` > 0 (Qwen2-MoE's, DeepSeek's)."""
    model = gpt.build(config, options)
    moe = MoEConfig(
        hidden=config.hidden,
        ffn_hidden=config.expert_width,  # by default about a dense MLP's active FLOPs
        num_experts=config.num_experts,
        top_k=config.top_k,
        renormalize=config.router_renormalize,
        capacity_factor=config.capacity_factor,
        aux_loss_coef=config.aux_loss_weight,
        z_loss_coef=config.router_z_loss_weight,
        seq_aux_loss_coef=config.seq_aux_loss_weight,
        score=config.router,
        groups=config.router_groups,
        group_topk=config.router_group_topk,
        scale=config.router_scale,
    )
    for block in model.layers[1:-1]:
        block.mlp = MoEMLP(
            moe,
            aux_loss_scale=options.aux_loss_scale,
            shared_hidden=config.shared_width,
            shared_gate=config.shared_expert_gate,
        )
    return model


def routing_summary(model: ModelConfig) -> str:
    """One line saying how tokens choose their experts, for ``--dry-run``."""
    parts = [f"{model.router} top-{model.top_k} of {model.num_experts} experts"]
    if model.router_groups > 1:
        parts.append(f"within the best {model.router_group_topk} of {model.router_groups} groups")
    if model.router == "sigmoid":
        parts.append(f"selection bias moved {model.router_bias_update_rate:g} a step by the global load")
    if model.router_scale != 1.0:
        parts.append(f"weights x {model.router_scale:g}")
    losses = {"switch": model.aux_loss_weight, "sequence-wise": model.seq_aux_loss_weight,
              "z": model.router_z_loss_weight}  # fmt: skip
    weighted = [f"{name} {weight:g}" for name, weight in losses.items() if weight > 0]
    parts.append("balance losses: " + (", ".join(weighted) if weighted else "none"))
    return "routing: " + "; ".join(parts)


def tp_plan(model: ModelConfig, parallel: ParallelSizes) -> dict[str, object]:
    """Attention and vocabulary as the GPT's; the routed experts are not split by tp (ep splits them),
    the shared experts are, like the dense MLP (their gate's one vector is replicated)."""
    plan: dict[str, object] = {}
    for i in range(1, model.num_layers + 1):
        plan |= attention_plan(f"layers.{i}", model, parallel)
        if model.shared_experts:
            plan |= mlp_plan(f"layers.{i}", parallel.sequence_parallel, "swiglu", mlp="mlp.shared_expert")
    return plan | split_sequence(1, parallel.sequence_parallel) | gpt.vocab_plan(model, parallel)


def check_model(model: ModelConfig) -> None:
    if not 1 <= model.top_k <= model.num_experts:
        raise ConfigError(f"model.top_k={model.top_k} must be between 1 and model.num_experts={model.num_experts}")


def check(model: ModelConfig, parallel: ParallelSizes) -> None:
    par = parallel
    if par.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel with model.kind='moe-gpt' is not supported (experts replicated over tp "
            "would see different tokens); turn sequence_parallel off"
        )
    if par.ep > 1 and par.zero_stage == 3:
        # ZeRO-3 shards every parameter of a stage over dp x ep, but each ep rank holds different experts.
        raise ConfigError(
            f"parallel.zero_stage=3 with parallel.ep={par.ep} is not supported (experts differ between ep ranks "
            "and cannot be sharded over them); use zero_stage 0-2 with experts, or ep=1"
        )
    if model.shared_experts:
        check_mlp_split(model.shared_width, par.tp)
    if model.num_experts % par.ep:
        raise ConfigError(
            f"parallel.ep={par.ep} does not divide model.num_experts={model.num_experts}; "
            f"choose ep in {divisors(model.num_experts)}"
        )


SPEC = ModelSpec(
    kind="moe-gpt",
    task="language",
    build=build,
    tp_plan=tp_plan,
    has_experts=True,
    tied=gpt.tied,
    check=check,
    check_model=check_model,
    context_parallel=True,  # each cp rank routes its chunks; aux losses, capacity over the cp group (ep.token_group)
    hf_families=(MIXTRAL, QWEN3_MOE, QWEN2_MOE),
)
