"""The column-parallel linear as one autograd Function, so its backward can overlap communication.

Built from the region collectives, a column-parallel layer is two autograd nodes::

    x -> enter (copy_to / all_gather) -> F.linear -> y

and its backward runs them one after the other: ``F.linear``'s backward computes
the input gradient *and* the weight gradient, and only then does the entry's
backward all-reduce the input gradient (reduce-scatter it under sequence
parallelism), blocking until the sum arrives. Nothing else runs while the
network works.

Fusing the two into one Function lets backward reorder its work as Megatron-LM
does (its ``LinearWithGradAccumulationAndAsyncCommunication``)::

    1. grad_input  = grad_y @ W          the previous layer waits for this one
    2. post the sum of grad_input        async all-reduce (SP: reduce-scatter)
    3. grad_weight = grad_y^T @ input    needs no communication: it runs while
       grad_bias   = grad_y summed       the sum of step 2 is on the wire
    4. wait for step 2, return

The numbers are the same as the two-node version: every tensor is computed by the
same kernels on the same operands, only in a different order, and the sum over
tp is the same collective on the same buffer.

Under sequence parallelism the forward all-gathers the input (B, S/tp, I) ->
(B, S, I) and the weight gradient needs that gathered input again. By default it
is saved (the same memory the two-node version saves, and no extra
communication). ``regather_input=True`` saves only this rank's shard (1/tp of
that memory) and all-gathers it again in backward, overlapped with step 1, as
Megatron does::

    0. post the all-gather of the saved shard
    1. grad_input = grad_y @ W           runs while the shard is gathered
    1b. wait for the gathered input
    2-4 as above

which costs one more all-gather of the input per layer in backward.

``overlap_forward_gather=True`` (SP only) overlaps the forward all-gather too:
this rank multiplies its own sequence shard while the other shards arrive, then
the rest. It splits one matmul into tp smaller ones and copies the output once
more, so it pays only when the gather takes about as long as a shard's matmul.

Shapes: B batch, S sequence, I in features, O/tp this rank's out features.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from polyshard.collectives import eager, ops
from polyshard.tp.errors import TPError
from polyshard.tp.regions import enter_region


def check_options(
    sequence_parallel: bool, input_entered: bool, overlap: bool, regather_input: bool, overlap_forward_gather: bool
) -> None:
    """``regather_input`` and ``overlap_forward_gather`` change the sequence-parallel entry's all-gather,
    so they need one: a :class:`TPError` otherwise."""
    if (regather_input or overlap_forward_gather) and not (overlap and sequence_parallel and not input_entered):
        raise TPError(
            "regather_input and overlap_forward_gather act on the sequence-parallel entry's all-gather: "
            "use them with sequence_parallel=True, overlap=True and input_entered=False"
        )


def _gather_while_multiplying(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dim: int,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gathered input, output): this rank's shard is multiplied while the all-gather brings the others."""
    gathering = ops.start_all_gather(x, dim, group)
    mine = F.linear(x, weight, bias)  # (B, S/tp, I) @ (I, O/tp): overlaps the gather
    total = gathering.wait()  # (B, S, I)
    rank = dist.get_rank(group)
    pieces = [
        mine if i == rank else F.linear(piece, weight, bias)
        for i, piece in enumerate(total.chunk(ops.world_size(group), dim))
    ]
    return total, torch.cat(pieces, dim)


# ctx is Any: forward keeps its options on it as attributes, which torch's FunctionCtx does not declare.
class _ColumnParallelMatmul(torch.autograd.Function):
    """forward: enter the tp region (identity / SP: all-gather) and multiply /
    backward: sum grad_input over tp while computing the weight gradients (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        sequence_dim: int,
        regather_input: bool,
        overlap_forward_gather: bool,
    ) -> torch.Tensor:
        if not sequence_parallel:
            total = x  # entering the region is the identity
            y = F.linear(x, weight, bias)  # (B, S, I) @ (I, O/tp) -> (B, S, O/tp)
        elif overlap_forward_gather:
            total, y = _gather_while_multiplying(x, weight, bias, sequence_dim, group)
        else:
            total = ops.all_gather(x, sequence_dim, group)  # (B, S/tp, I) -> (B, S, I)
            y = F.linear(total, weight, bias)
        regather = sequence_parallel and regather_input
        ctx.save_for_backward(x if regather else total, weight)
        ctx.group, ctx.sequence_parallel, ctx.sequence_dim = group, sequence_parallel, sequence_dim
        ctx.regather, ctx.has_bias = regather, bias is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved_input, weight = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        group, dim = ctx.group, ctx.sequence_dim

        # 0. (SP, regather_input) the weight gradient needs the whole input: post its all-gather first.
        gathering = ops.start_all_gather(saved_input, dim, group) if ctx.regather and need_weight else None

        # 1. This rank's part of the input gradient: a partial sum over its O/tp output features.
        summing = None
        if need_input:
            grad_total = grad_y.matmul(weight)  # (B, S, O/tp) @ (O/tp, I) -> (B, S, I)
            # 2. Post its sum over tp; the layer before this one waits for it, nothing below does.
            if ctx.sequence_parallel:
                summing = ops.start_reduce_scatter(grad_total, dim, group)  # -> (B, S/tp, I), summed
            else:
                summing = ops.start_all_reduce(grad_total, group)

        # 3. Local work while the sum is on the wire: the weight and bias gradients.
        grad_weight = grad_bias = None
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])  # (B*S, O/tp)
        if need_weight:
            total = gathering.wait() if gathering is not None else saved_input
            grad_weight = grad_2d.t().mm(total.reshape(-1, total.shape[-1]))  # (O/tp, B*S) @ (B*S, I)
        if need_bias and ctx.has_bias:
            grad_bias = grad_2d.sum(0)

        # 4. Wait for the input gradient's sum.
        grad_input = summing.wait() if summing is not None else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


@eager  # a graph break: its backward reorders async collectives (see the README)
def column_parallel_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    *,
    sequence_parallel: bool = False,
    sequence_dim: int = 1,
    regather_input: bool = False,
    overlap_forward_gather: bool = False,
) -> torch.Tensor:
    """``F.linear(enter_region(x), weight, bias)`` whose backward overlaps the input gradient's sum
    over ``group`` with the weight gradient (see the module docstring).

    On a group of one rank it is ``F.linear``. Under autocast it falls back to the two-node version:
    the Function would have to redo autocast's casts in backward.
    """
    if ops.world_size(group) == 1:
        return F.linear(x, weight, bias)
    if torch.is_autocast_enabled(x.device.type):
        return F.linear(enter_region(x, group, sequence_parallel, sequence_dim), weight, bias)
    return _ColumnParallelMatmul.apply(  # type: ignore[no-untyped-call,no-any-return]
        x, weight, bias, group, sequence_parallel, sequence_dim, regather_input, overlap_forward_gather
    )
