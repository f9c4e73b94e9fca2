"""All-gather attention: every rank gathers all keys and values once, then attends with its own
queries to the keys it may see (the context parallelism of Llama 3, Dubey et al. 2407.21783,
section 3.3.2, on the same load-balanced layout as the ring).

Shapes: B batch, N query heads, K key/value heads, S = 2C local tokens, cp ranks, D/E head dims.

Forward: all-gather K and V along the sequence in their dtype (each rank sends (cp-1)/cp of the
full K and V), put the 2 cp chunks in sequence order, and for each local
query chunk i attend to the keys of chunks 0..i only (causal: the later chunks are never
touched; the last visible chunk is masked to its causal triangle). Non-causal: every local
query against every key.

Document masking (``segments``: each local token's document within its row): the ids are all-gathered
too (int64, B x S), a query chunk attends only to keys from the start of its first document's first
token (the keys before it, in earlier documents of every row, are never touched), and the rest is
masked to the query's own document. Every query sees itself, so no softmax row is empty.

Sliding windows: a query chunk's keys start no earlier than ``window - 1`` tokens before its first
query (the slice is all that is touched), and the window masks the rest. Sinks: one more logit per head
in each softmax, differentiated by autograd like the rest.

Backward: plain autograd through the float32 maths; the all-gather's backward is a float32
reduce-scatter, which sums every rank's gradient for a key/value chunk onto the rank that owns it.

Against the ring: one collective instead of cp - 1 point-to-point steps and no merging, but the
full K and V (and their gradients) are materialised on every rank; the ring holds two blocks at a
time. Both compute the same blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.cp.blocks import grouped_kv, grouped_query, ungrouped, window_hidden
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


def _dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    hidden: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention in float32, differentiable by autograd; ``hidden`` (Q, T) marks masked keys;
    ``sinks`` (N,): one more logit per head in each row's softmax, whose column is then dropped."""
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, K, G, Q, D) @ (B, K, 1, D, T) -> (B, K, G, Q, T)
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v  # (B, K, G, Q, T) @ (B, K, 1, T, E) -> (B, K, G, Q, E)
    b, kv_heads, g, rows, _ = scores.shape
    sink = sinks.float().reshape(1, kv_heads, g, 1, 1).expand(b, kv_heads, g, rows, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v


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
    keys = grouped_kv(to_sequence_order(_gather_float32(k, 2, group), 2, cp))  # (B, K, 1, 2C cp, D)
    values = grouped_kv(to_sequence_order(_gather_float32(v, 2, group), 2, cp))
    queries = grouped_query(q.float(), k.shape[1])  # (B, K, G, 2C, D)
    every = None if segments is None else to_sequence_order(ops.all_gather(segments, 1, group), 1, cp)  # (B, S)
    if not causal and every is None:
        return ungrouped(_dense(queries, keys, values, scale, None, sinks)).to(q.dtype)
    chunk = q.shape[2] // 2
    outs = []
    for half, i in enumerate(rank_chunks(rank, cp)):
        local = slice(half * chunk, (half + 1) * chunk)
        visible = (i + 1) * chunk if causal else keys.shape[-2]  # causal: keys of chunks 0..i
        first = 0 if every is None or segments is None else _first_key(segments[:, local], every)
        if window is not None:  # the keys before the window of the chunk's first query: never touched
            first = max(first, i * chunk - window + 1)
        query_pos = torch.arange(i * chunk, (i + 1) * chunk, device=q.device).unsqueeze(-1)
        key_pos = torch.arange(first, visible, device=q.device)
        hidden = key_pos > query_pos  # (C, visible - first): later keys
        if not causal:
            hidden.zero_()
        if window is not None:
            hidden |= window_hidden(query_pos.squeeze(-1), key_pos, window)
        if every is not None and segments is not None:  # (B, 1, 1, C, visible - first): another document
            other = segments[:, local].unsqueeze(-1) != every[:, first:visible].unsqueeze(-2)
            hidden = (hidden | other)[:, None, None]
        cols = slice(first, visible)
        outs.append(_dense(queries[..., local, :], keys[..., cols, :], values[..., cols, :], scale, hidden, sinks))
    return ungrouped(torch.cat(outs, dim=-2)).to(q.dtype)
