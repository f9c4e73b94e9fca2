"""Block-sparse attention: softmax attention over key/value blocks with an online softmax, computing only the
blocks a causal mask, a sliding window or the documents leave visible, so memory grows with S x block rather
than S^2, on any device. The models' ``blocksparse`` attention core runs it over a whole sequence; all-gather
context parallelism runs it for each local query chunk over the gathered keys it may see.

Shapes, as :mod:`polyshard.cp.blocks` (whose per-block kernels and merge this shares with ring attention):
B batch, N = K x G query heads over K key/value heads, Q queries, T keys, D query/key head dim, E value head
dim; q (B, N, Q, D), k (B, K, T, D), v (B, K, T, E), sinks (N,), segments (B, Q) and key segments (B, T).
The queries sit at positions ``query_start ..`` of their sequence and the keys at ``key_start ..`` (both 0
for one whole sequence).

The plan: a key is visible to a query when all of these hold: ``causal``, it is not later; ``window`` W, it
is one of the W tokens ending at the query (positions q - W < k <= q, Hugging Face's ``sliding_window``);
``segments``, it is in the query's document. A (query block, key block) pair is *skipped* when no pair in it
is visible in any row, *full* when every pair is (no mask needed), and *partial* otherwise. Documents are
judged from each block's smallest and largest document index: two blocks share no document when those ranges
do not overlap (rows are non-decreasing, so this is exact for them).

S = 8, block 2, causal, one document [0 0 0 1 1 1 1 1] (x: full, m: partial, .: skipped)::

    key block    0 1 2 3
    query 0      m . . .        query 1 (positions 2, 3) sees key 2 of block 1 but not key 3
    query 1      m m . .        (another document, and the diagonal's later key)
    query 2      . m m .
    query 3      . m x m

forward: for each planned block pair, softmax attention of the query block over the key block, merged into a
float32 (out, lse) accumulator by the log-sum-exp rule (Milakov and Gimelshein 1805.02867); then the sinks join
each row's denominator. backward: FlashAttention's (Dao et al. 2205.14135, appendix B): only q, k, v, out and
lse are saved; each block's probabilities are recomputed from the final lse, so no Q x T matrix ever exists,
in either pass.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from polyshard.collectives import eager
from polyshard.cp.blocks import (
    add_sinks,
    block_backward,
    block_forward,
    grouped_kv,
    grouped_query,
    merge_into,
    sink_gradient,
    ungrouped,
    window_hidden,
)

BLOCK = 256
"""Tokens per block a side: (B, N, 256, 256) float32 scores per step, large enough for matmuls to run
near their peak on a CPU, small enough to skip a short document's blocks."""


class BlockPlan(NamedTuple):
    """The block pairs to compute, (query block, key block, partial) in query-block order, out of
    ``total`` pairs; ``block`` tokens a side (the last block of each side may be shorter)."""

    block: int
    pairs: list[tuple[int, int, bool]]
    total: int

    @property
    def skipped(self) -> int:
        """Block pairs never computed (no visible key in them): the work and memory the mask saves."""
        return self.total - len(self.pairs)


class Visibility(NamedTuple):
    """Which keys each query sees: ``causal``, ``window`` (tokens, itself included), documents (``segments``
    of the queries (B, Q) and ``key_segments`` of the keys (B, T)), and where both sit in their sequence."""

    causal: bool
    window: int | None = None
    segments: torch.Tensor | None = None
    key_segments: torch.Tensor | None = None
    query_start: int = 0
    key_start: int = 0

    def blocks(self, plan: BlockPlan, queries: int, keys: int, device: torch.device) -> Any:
        """(rows, cols, hidden or None, diagonal) of each planned pair: hidden (:func:`block_hidden`) for a
        partial one, except the causal triangle alone (a causal mask's square block on the diagonal, no
        window or documents), which is ``diagonal`` with no mask, as :func:`~polyshard.cp.blocks.block_forward`
        takes it."""
        size = plan.block
        plain_causal = self.causal and self.window is None and self.segments is None
        for i, j, partial in plan.pairs:
            rows = slice(i * size, min((i + 1) * size, queries))
            cols = slice(j * size, min((j + 1) * size, keys))
            square = rows.stop - rows.start == cols.stop - cols.start
            if partial and plain_causal and square and self.query_start + rows.start == self.key_start + cols.start:
                yield rows, cols, None, True
            else:
                yield rows, cols, block_hidden(self, rows, cols, device) if partial else None, False


def _first_and_last(start: int, length: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    first = torch.arange(-(-length // block)) * block
    return start + first, start + (first + block).clamp(max=length) - 1


def plan_sparse_blocks(queries: int, keys: int, block: int, seen: Visibility) -> BlockPlan:
    """The :class:`BlockPlan` of ``queries`` queries against ``keys`` keys cut into blocks of ``block`` tokens."""
    q_first, q_last = (t[:, None] for t in _first_and_last(seen.query_start, queries, block))
    k_first, k_last = (t[None, :] for t in _first_and_last(seen.key_start, keys, block))
    n, m = q_first.shape[0], k_first.shape[1]
    visible = torch.ones(n, m, dtype=torch.bool)  # (query block, key block): some key visible
    full = torch.ones(n, m, dtype=torch.bool)  # every key visible to every query
    if seen.causal:
        visible &= k_first <= q_last
        full &= k_last <= q_first
    if seen.window is not None:
        visible &= q_first - k_last < seen.window
        full &= q_last - k_first < seen.window
    if seen.segments is not None:
        key_segments = seen.segments if seen.key_segments is None else seen.key_segments
        q_low, q_high = _block_ranges(seen.segments.cpu(), block, n)  # (B, n) each
        k_low, k_high = _block_ranges(key_segments.cpu(), block, m)  # (B, m) each
        overlap = (q_low[:, :, None] <= k_high[:, None, :]) & (k_low[:, None, :] <= q_high[:, :, None])
        visible &= overlap.any(dim=0)
        one = (q_low == q_high)[:, :, None] & (k_low == k_high)[:, None, :] & (q_low[:, :, None] == k_low[:, None, :])
        full &= one.all(dim=0)
    pairs = [(i, j, not full[i, j].item()) for i, j in visible.nonzero().tolist()]
    return BlockPlan(block, pairs, n * m)


def _block_ranges(segments: torch.Tensor, block: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's smallest and largest document index, (B, n) each; the last block is padded with its
    own last token, which changes neither."""
    pad = n * block - segments.shape[1]
    padded = torch.cat([segments, segments[:, -1:].expand(-1, pad)], dim=1) if pad else segments
    blocks = padded.reshape(segments.shape[0], n, block)
    return blocks.amin(dim=-1), blocks.amax(dim=-1)


def block_hidden(seen: Visibility, rows: slice, cols: slice, device: torch.device) -> torch.Tensor:
    """The keys of one partial block hidden from each query: (Q, T) bool, or (B, 1, 1, Q, T) with
    documents, broadcasting over the (B, K, G, Q, T) scores of :mod:`polyshard.cp.blocks`."""
    query = torch.arange(seen.query_start + rows.start, seen.query_start + rows.stop, device=device)
    key = torch.arange(seen.key_start + cols.start, seen.key_start + cols.stop, device=device)
    hidden = torch.zeros(len(query), len(key), dtype=torch.bool, device=device)
    if seen.causal:
        hidden |= key[None, :] > query[:, None]
    if seen.window is not None:
        hidden |= window_hidden(query, key, seen.window)
    if seen.segments is None:
        return hidden
    key_segments = seen.segments if seen.key_segments is None else seen.key_segments
    other = seen.segments[:, rows, None] != key_segments[:, None, cols]  # (B, Q, 1) != (B, 1, T)
    return (hidden | other)[:, None, None]


class BlockSparseAttention(torch.autograd.Function):
    """forward: online softmax over the planned key/value blocks, then the sinks / backward: recompute
    each planned block's probabilities from the saved lse (FlashAttention), dK/dV summed per key head."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        mask: Visibility,
        plan: BlockPlan,
        scale: float,
    ) -> torch.Tensor:
        kv_heads = k.shape[1]
        q32 = grouped_query(q.float(), kv_heads)  # (B, K, G, S, D)
        k32, v32 = grouped_kv(k.float()), grouped_kv(v.float())  # (B, K, 1, S, D), (B, K, 1, S, E)
        out = q32.new_zeros(q32.shape[:-1] + (v.shape[-1],))  # (B, K, G, S, E) float32
        lse = q32.new_full(q32.shape[:-1], float("-inf"))  # (B, K, G, S) float32
        for rows, cols, hidden, diagonal in mask.blocks(plan, q.shape[2], k.shape[2], q.device):
            block_out, block_lse = block_forward(
                q32[..., rows, :], k32[..., cols, :], v32[..., cols, :], scale, diagonal, hidden
            )
            merge_into(out[..., rows, :], lse[..., rows], block_out, block_lse, masked=hidden is not None)
        if sinks is not None:
            add_sinks(out, lse, sinks.float())
        # The float32 out (not the returned one): rowsum(dO * O) in backward starts from it unrounded.
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mask, ctx.plan, ctx.scale = mask, plan, scale
        return ungrouped(out).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, sinks, out, lse = ctx.saved_tensors
        kv_heads = k.shape[1]
        q32 = grouped_query(q.float(), kv_heads)
        k32, v32 = grouped_kv(k.float()), grouped_kv(v.float())
        dout32 = grouped_query(dout.float(), kv_heads)  # (B, K, G, S, E)
        delta = (dout32 * out).sum(dim=-1)  # rowsum(dO * O): (B, K, G, S)
        dq, dk, dv = torch.zeros_like(q32), torch.zeros_like(k32), torch.zeros_like(v32)
        for rows, cols, hidden, diagonal in ctx.mask.blocks(ctx.plan, q.shape[2], k.shape[2], q.device):
            dq_b, dk_b, dv_b = block_backward(
                q32[..., rows, :],
                k32[..., cols, :],
                v32[..., cols, :],
                dout32[..., rows, :],
                lse[..., rows],
                delta[..., rows],
                ctx.scale,
                diagonal,
                hidden,
                out[..., rows, :],
            )
            dq[..., rows, :] += dq_b
            dk[..., cols, :] += dk_b
            dv[..., cols, :] += dv_b
        dsinks = None if sinks is None else sink_gradient(sinks.float(), lse, delta).to(sinks.dtype)
        dq_out = ungrouped(dq).to(q.dtype)
        return dq_out, dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype), dsinks, None, None, None


@eager  # data-dependent block loop: torch.compile runs it eagerly (a graph break) rather than tracing it
def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    segments: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    block: int = BLOCK,
    key_segments: torch.Tensor | None = None,
    query_start: int = 0,
    key_start: int = 0,
) -> torch.Tensor:
    """Attention of (B, N, Q, D) queries over (B, K, T, D) keys and (B, K, T, E) values: (B, N, Q, E) in q's
    dtype, computed in float32. By default one whole sequence attending to itself (Q = T, both starting at
    position 0); ``query_start`` / ``key_start`` place them elsewhere in their sequence, and ``key_segments``
    gives the keys' documents when they are not the queries'. ``causal``, ``window`` (tokens each query
    sees, itself included) and ``segments`` (B, Q, each query's document) choose the visible keys;
    ``sinks`` (N,): one learned logit per head added to every softmax denominator (gpt-oss)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    seen = Visibility(causal, window, segments, key_segments, query_start, key_start)
    plan = plan_sparse_blocks(q.shape[2], k.shape[2], block, seen)
    return BlockSparseAttention.apply(q, k, v, sinks, seen, plan, scale)  # type: ignore[no-untyped-call,no-any-return]
