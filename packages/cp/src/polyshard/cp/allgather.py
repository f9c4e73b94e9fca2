"""All-gather attention: every rank gathers all keys and values once, then attends with its own
queries to the keys it may see (the context parallelism of Llama 3, Dubey et al. 2407.21783,
section 3.3.2, on the same load-balanced layout as the ring).

Shapes: B batch, N query heads, K key/value heads, S = 2C local tokens, cp ranks, D/E head dims.

Forward: all-gather K and V along the sequence in their dtype (each rank sends (cp-1)/cp of the
full K and V), put the 2 cp chunks in sequence order, and for each local query chunk i attend to the
keys of chunks 0..i only (causal: the later chunks are never touched) with the block-sparse kernel
(:mod:`polyshard.cp.blocksparse`): key blocks a query block cannot see are skipped, the rest merged by
an online softmax, so no (chunk x visible keys) score matrix exists. Non-causal: every local query
against every key.

Document masking (``segments``: each local token's document within its row): the ids are all-gathered
too (int64, B x S), a query chunk attends only to keys from the start of its first document's first
token (the keys before it, in earlier documents of every row, are never touched), and the block-sparse
plan skips the key blocks of other documents. Every query sees itself, so no softmax row is empty.

Sliding windows: a query chunk's keys start no earlier than ``window - 1`` tokens before its first
query (the slice is all that is touched), and the plan skips the blocks outside the window. Sinks: one
more logit per head in each softmax.

Backward: the block-sparse kernel's (FlashAttention's recomputation from the saved log-sum-exp), with
dK and dV in float32; the all-gather's backward is a float32 reduce-scatter, which sums every rank's
gradient for a key/value chunk onto the rank that owns it.

Against the ring: one collective instead of cp - 1 point-to-point steps, but the
full K and V (and their gradients) are materialised on every rank; the ring holds two blocks at a
time. Both compute the same blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.cp.blocksparse import block_sparse_attention
from polyshard.cp.sharding import rank_chunks, to_sequence_order


class _AllGatherToFloat32(torch.autograd.Function):
    """forward: all-gather along dim in the input's dtype, then float32 /
    backward: reduce-scatter of the float32 gradient, then the input's dtype.

    ``polyshard.collectives.all_gather`` followed by ``.float()`` would round the gradient to bf16
    before the reduce-scatter sums it over ranks; this sums in float32 and rounds once, as the
    ring does with its float32 dK/dV.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.dtype = dim, group, x.dtype
        return ops.all_gather(x, dim, group).float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ops.reduce_scatter(grad.float(), ctx.dim, ctx.group).to(ctx.dtype), None, None


def _gather_float32(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _AllGatherToFloat32.apply(x, dim, group)  # type: ignore[no-untyped-call,no-any-return]


def _first_key(query_segments: torch.Tensor, all_segments: torch.Tensor) -> int:
    """The first key any of these queries (B, C) may see in the whole rows' documents (B, S): where the
    earliest of their documents starts (rows are non-decreasing), in the row where that is earliest."""
    if query_segments.numel() == 0:  # an empty batch (evaluation's last part may hold no rows)
        return 0
    starts = torch.searchsorted(all_segments.contiguous(), query_segments[:, :1].contiguous())  # (B, 1)
    return int(starts.min())


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    causal: bool,
    scale: float,
    segments: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather attention of local (B, N, S, D) queries over (B, K, S, D) keys and (B, K, S, E)
    values of a sequence sharded by :func:`~polyshard.cp.sharding.shard_sequence`: (B, N, S, E).
    ``segments`` (B, S): the local tokens' documents, sharded alike; attention then stays inside each.
    ``window`` (causal): each query sees its last ``window`` tokens, so a chunk's keys start no earlier
    than ``window - 1`` before its first query; ``sinks`` (N,): per-head sink logits (gpt-oss)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    keys = to_sequence_order(_gather_float32(k, 2, group), 2, cp)  # (B, K, 2C cp, D) float32
    values = to_sequence_order(_gather_float32(v, 2, group), 2, cp)  # (B, K, 2C cp, E) float32
    every = None if segments is None else to_sequence_order(ops.all_gather(segments, 1, group), 1, cp)  # (B, S)
    if not causal and every is None:
        return block_sparse_attention(q, keys, values, causal=False, sinks=sinks, scale=scale)
    chunk = q.shape[2] // 2
    outs = []
    for half, i in enumerate(rank_chunks(rank, cp)):
        local = slice(half * chunk, (half + 1) * chunk)
        visible = (i + 1) * chunk if causal else keys.shape[-2]  # causal: keys of chunks 0..i
        first = 0 if every is None or segments is None else _first_key(segments[:, local], every)
        if window is not None:  # the keys before the window of the chunk's first query: never touched
            first = max(first, i * chunk - window + 1)
        cols = slice(first, visible)
        outs.append(
            block_sparse_attention(
                q[:, :, local],
                keys[:, :, cols],
                values[:, :, cols],
                causal=causal,
                window=window,
                segments=None if segments is None else segments[:, local],
                key_segments=None if every is None else every[:, cols],
                sinks=sinks,
                scale=scale,
                query_start=i * chunk,
                key_start=first,
            )
        )
    return torch.cat(outs, dim=2)
