"""Autograd-aware collectives: each forward has its conjugate as backward.

The f/g pair of Megatron-LM (Shoeybi et al., 1909.08053, section 3):

    copy_to       forward: identity        backward: all-reduce
    reduce_from   forward: all-reduce      backward: identity

Gathering and splitting along a tensor dim (tensor parallel outputs/inputs):

    gather_from   forward: all-gather      backward: split (keep own piece)
    scatter_to    forward: split           backward: all-gather

Sequence parallelism (Korthikanti et al., 2205.05198, section 4.2.2):

    reduce_scatter  forward: reduce-scatter  backward: all-gather
    all_gather      forward: all-gather      backward: reduce-scatter

Expert parallelism: ``all_to_all`` with uneven splits; backward sends every
gradient row back to the rank its input row came from (the reverse exchange).

All take ``group=None`` for the world; on a group of size 1 every one of them
is the identity.

Under ``torch.compile`` each is a graph break (:func:`~polyshard.collectives.graph_break.eager`): it runs eagerly, as
written, between compiled pieces; polyshard-tp's README says why (measured) rather than tracing
them as functional collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.collectives.graph_break import eager


# ctx is Any in every Function here: forward keeps its arguments on it as attributes,
# which torch's FunctionCtx does not declare.
class _CopyTo(torch.autograd.Function):
    """forward: identity / backward: all-reduce (Megatron's f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        ops.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    """forward: all-reduce / backward: identity (Megatron's g)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        out = x.contiguous().clone()
        ops.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFrom(torch.autograd.Function):
    """forward: all-gather along dim / backward: split along dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return ops.all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ops.split(grad, ctx.dim, ctx.group), None, None


class _ScatterTo(torch.autograd.Function):
    """forward: split along dim / backward: all-gather along dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return ops.split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ops.all_gather(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    """forward: reduce-scatter along dim / backward: all-gather along dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return ops.reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ops.all_gather(grad, ctx.dim, ctx.group), None, None


class _AllGather(torch.autograd.Function):
    """forward: all-gather along dim / backward: reduce-scatter along dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return ops.all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ops.reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all with splits / backward: the reverse all-to-all."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (list(output_split_sizes), list(input_split_sizes)), group
        return ops.all_to_all(x, output_split_sizes, input_split_sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_split_sizes, input_split_sizes = ctx.splits
        # What arrived from rank j goes back to rank j.
        return ops.all_to_all(grad, input_split_sizes, output_split_sizes, ctx.group), None, None, None


# Function.apply is untyped in torch (it returns what forward returns), hence the ignores below.
def _trivial(group: dist.ProcessGroup | None) -> bool:
    return dist.get_world_size(group) == 1


@eager
def copy_to(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward."""
    return x if _trivial(group) else _CopyTo.apply(x, group)  # type: ignore[no-untyped-call]


@eager
def reduce_from(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward."""
    return x if _trivial(group) else _ReduceFrom.apply(x, group)  # type: ignore[no-untyped-call]


@eager
def gather_from(x: torch.Tensor, dim: int = -1, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather along ``dim`` forward; keep this rank's piece of the gradient backward."""
    return x if _trivial(group) else _GatherFrom.apply(x, dim, group)  # type: ignore[no-untyped-call]


@eager
def scatter_to(x: torch.Tensor, dim: int = -1, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Keep this rank's piece along ``dim`` forward; all-gather the gradient backward."""
    return x if _trivial(group) else _ScatterTo.apply(x, dim, group)  # type: ignore[no-untyped-call]


@eager
def reduce_scatter(x: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce-scatter along ``dim`` forward; all-gather backward (sequence-parallel exit)."""
    return x if _trivial(group) else _ReduceScatter.apply(x, dim, group)  # type: ignore[no-untyped-call]


@eager
def all_gather(x: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather along ``dim`` forward; reduce-scatter backward (sequence-parallel entry)."""
    return x if _trivial(group) else _AllGather.apply(x, dim, group)  # type: ignore[no-untyped-call]


@eager
def all_to_all(
    x: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Uneven all-to-all of rows (dim 0); backward returns each gradient row to its sender."""
    if _trivial(group):
        return x
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)  # type: ignore[no-untyped-call,no-any-return]
