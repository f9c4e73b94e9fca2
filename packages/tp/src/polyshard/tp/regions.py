"""Entering and leaving the tensor-parallel region, with and without sequence parallelism.

Megatron-LM (Shoeybi et al., 1909.08053) brackets each tensor-parallel pair
(column-parallel then row-parallel) with the conjugates f and g:

    enter  f: forward identity            backward all-reduce
    leave  g: forward all-reduce          backward identity

Sequence parallelism (Korthikanti et al., 2205.05198) keeps the activations
*between* the pairs split along the sequence dim, so norms, dropout and the
residual add run on 1/tp of the tokens. The conjugates become:

    enter  forward all-gather (seq dim)   backward reduce-scatter
    leave  forward reduce-scatter         backward all-gather

An all-reduce of a buffer is a reduce-scatter followed by an all-gather, so
sequence parallelism moves the same number of bytes while storing 1/tp of
the activations between the pairs.

Replicated parameters inside the sequence-parallel part (norm weights, the
bias of a row-parallel layer) see only this rank's tokens, so their gradients
are partial sums: :func:`sync_sequence_parallel_grads` sums them over the tp
group. We chose an explicit call (as Megatron's ``finalize_model_grads`` does)
over per-parameter hooks: it runs once per optimizer step, even with gradient
accumulation, and packs every such gradient into one all-reduce.

Shapes: B batch, S sequence, H hidden; activations are (B, S, H), seq dim 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from polyshard.collectives import all_gather, copy_to, ops, reduce_from, reduce_scatter, scatter_to
from polyshard.tp.shard import is_sequence_parallel


def enter_region(
    x: torch.Tensor, tp_group: dist.ProcessGroup | None, sequence_parallel: bool = False, sequence_dim: int = 1
) -> torch.Tensor:
    """forward: identity, or all-gather (B, S/tp, H) -> (B, S, H) with SP /
    backward: all-reduce, or reduce-scatter with SP."""
    if sequence_parallel:
        return all_gather(x, sequence_dim, tp_group)
    return copy_to(x, tp_group)


def leave_region(
    y: torch.Tensor, tp_group: dist.ProcessGroup | None, sequence_parallel: bool = False, sequence_dim: int = 1
) -> torch.Tensor:
    """forward: all-reduce of partial sums, or reduce-scatter (B, S, H) -> (B, S/tp, H) with SP /
    backward: identity, or all-gather with SP."""
    if sequence_parallel:
        return reduce_scatter(y, sequence_dim, tp_group)
    return reduce_from(y, tp_group)


def split_sequence(x: torch.Tensor, tp_group: dist.ProcessGroup | None, sequence_dim: int = 1) -> torch.Tensor:
    """forward: keep this rank's piece (B, S, H) -> (B, S/tp, H) / backward: all-gather.

    Where a replicated activation (e.g. token + position embeddings) enters the
    sequence-parallel part; no communication forward.
    """
    return scatter_to(x, sequence_dim, tp_group)


def sync_sequence_parallel_grads(model: torch.nn.Module, tp_group: dist.ProcessGroup | None) -> int:
    """Sum over ``tp_group`` the gradients of every parameter flagged sequence-parallel.

    Call after ``backward`` (after the last micro-batch) and before the
    optimizer step, on every rank of the group. Packs the gradients into one
    flat buffer so the whole model costs one all-reduce. Returns how many
    gradients it summed.
    """
    grads = [p.grad for p in model.parameters() if is_sequence_parallel(p) and p.grad is not None]
    ops.all_reduce_coalesced(grads, tp_group)
    return len(grads)
