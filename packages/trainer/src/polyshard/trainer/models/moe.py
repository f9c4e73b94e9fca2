"""The GPT's mixture-of-experts variant: every block's MLP is a polyshard.ep MoE layer.

A pipeline passes one activation tensor between stages, but an MoE layer
also produces an auxiliary (load-balancing) loss. :class:`MoEMLP` attaches
that loss to the activation with an autograd function whose backward feeds
the aux loss its gradient (``aux_loss_scale``, 1/microbatches) while passing
the activation's gradient through — so every stage's aux loss is trained
without a second output, as Megatron-LM's MoE aux-loss scaler does.
"""

from __future__ import annotations

import torch
from torch import nn

from polyshard.ep import MoEConfig, MoELayer


class _AttachAuxLoss(torch.autograd.Function):
    """forward: identity on ``x`` / backward: ``x``'s gradient, and ``scale`` as the aux loss's gradient."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, device=grad.device), None


class MoEMLP(nn.Module):
    """``aux_loss_scale``: the aux loss's gradient; 1 / microbatches when a step accumulates several,
    as each microbatch's aux loss, like its cross-entropy, counts 1/m."""

    def __init__(self, config: MoEConfig, *, aux_loss_scale: float = 1.0):
        super().__init__()
        self.moe = MoELayer(config)
        self.aux_loss_scale = aux_loss_scale
        self.last_aux_loss = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux = self.moe(x)
        self.last_aux_loss = float(aux.detach())
        return _AttachAuxLoss.apply(y, aux, self.aux_loss_scale) if torch.is_grad_enabled() else y
