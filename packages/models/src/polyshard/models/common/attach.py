"""A loss that is not the model's output but trains with it: the MoE's balance losses, the MTP depths'.

The pipeline runs backward from the main loss only; :class:`AttachLoss` hangs another loss on an
activation the main loss depends on, so that loss's gradient enters the same backward pass."""

from __future__ import annotations

from typing import Any

import torch


class AttachLoss(torch.autograd.Function):
    """forward: identity on ``x`` / backward: ``x``'s gradient, and ``scale`` as ``loss``'s gradient.

    ``loss`` then trains as if ``scale * loss`` were added to whatever loss ``x`` feeds."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.loss_shape = scale, loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.loss_shape, ctx.scale, device=grad.device), None
