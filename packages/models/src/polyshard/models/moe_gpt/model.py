"""The GPT's mixture-of-experts variant: every block's MLP is an MoE layer (:mod:`polyshard.models.common.moe`).

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
from polyshard.models.common import MLP, SwiGLU
from polyshard.models.common.attach import AttachLoss
from polyshard.models.common.moe import MoEConfig, MoELayer
from polyshard.models.common.mtp import PredictionDepth
from polyshard.models.config import ModelConfig
from polyshard.models.decoder import decoder_shape, moe_config
from polyshard.models.gpt import model as gpt
from polyshard.models.moe_gpt.config import MoEGPTConfig
from polyshard.models.moe_gpt.hf import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from polyshard.models.moe_gpt.plan import check, tp_plan
from polyshard.models.moe_gpt.presets import PRESETS
from polyshard.models.spec import (
    BuildOptions,
    ModelSpec,
)


class MoEMLP(nn.Module):
    """The routed experts (``moe``), plus with ``shared_hidden`` > 0 a dense SwiGLU every token passes
    through beside them (``shared_expert``: Qwen2-MoE's and DeepSeek's shared experts, one MLP as wide
    as all of them), whose output ``shared_gate`` scales per token by sigmoid(x . w) (Qwen2-MoE).
    Under tp the shared expert splits like the dense MLP; the routed experts are ep's.

    ``aux_loss_scale``: the aux loss's gradient; 1 / microbatches when a step accumulates several,
    as each microbatch's aux loss, like its cross-entropy, counts 1/m."""

    def __init__(
        self,
        config: MoEConfig,
        *,
        hidden: int,
        ffn_hidden: int,
        aux_loss_scale: float = 1.0,
        shared_hidden: int = 0,
        shared_gate: bool = False,
    ):
        super().__init__()
        self.moe = MoELayer(config, hidden=hidden, ffn_hidden=ffn_hidden)
        self.shared_expert = SwiGLU(hidden, shared_hidden) if shared_hidden else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_gate else None
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
    model = gpt.build(config, options)
    config = moe_config(config)
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
            config.moe,
            hidden=config.hidden,
            ffn_hidden=config.expert_width,  # by default about a dense MLP's active FLOPs
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


SPEC = ModelSpec(
    shape=decoder_shape,
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
    hf_adapters=(MIXTRAL, QWEN3_MOE, QWEN2_MOE),
)
