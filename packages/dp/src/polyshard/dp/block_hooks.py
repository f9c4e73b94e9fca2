"""What ZeRO-3 hooks onto its blocks beyond gathers: the tensors of a block's output (to hook the start of
its backward), a pass-through of its inputs whose backward says the block's backward is done (FSDP2's
RegisterPostBackwardFunction), and parameters split by dtype (one flat buffer holds one dtype)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def by_dtype(named: list[tuple[str, nn.Parameter]]) -> list[list[tuple[str, nn.Parameter]]]:
    """``named`` split by dtype, in order of first appearance (one flat buffer holds one dtype)."""
    groups: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
    for n, p in named:
        groups.setdefault(p.dtype, []).append((n, p))
    return list(groups.values())


class _AfterBackward(torch.autograd.Function):
    """forward: identity on a block's inputs / backward: identity, then ``callback()`` (FSDP2's
    RegisterPostBackwardFunction): it runs once the gradients of all of them are computed."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def after_backward(args: tuple[Any, ...], callback: Callable[[], None]) -> tuple[Any, ...] | None:
    """``args`` with the tensors that need a gradient passed through :class:`_AfterBackward` (None: none do,
    and the caller frees at the end of the backward instead)."""
    positions = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not positions:
        return None
    passed = _AfterBackward.apply(callback, *(args[k] for k in positions))  # type: ignore[no-untyped-call]
    out = list(args)
    for k, tensor in zip(positions, passed):
        out[k] = tensor
    return tuple(out)


def tensors_in(output: object) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in tensors_in(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in tensors_in(o)]
    return []
