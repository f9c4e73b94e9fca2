"""The block-sparse core: attention over key/value blocks with an online softmax, computing only the
blocks a causal mask, a sliding window or the documents leave visible (:mod:`.plan`), so memory grows
with S x block rather than S^2, on any device.

Shapes, as :mod:`polyshard.cp.blocks` (whose per-block kernels and merge this core shares with ring
attention): B batch, N = K x G query heads over K key/value heads, S sequence, D query/key head dim,
E value head dim; q (B, N, S, D), k (B, K, S, D), v (B, K, S, E), sinks (N,), segments (B, S).

forward: for each planned block pair, softmax attention of the query block over the key block, merged
into a float32 (out, lse) accumulator by the log-sum-exp rule (Milakov and Gimelshein 1805.02867); then
the sinks join each row's denominator. backward: FlashAttention's (Dao et al. 2205.14135, appendix B):
only q, k, v, out and lse are saved; each block's probabilities are recomputed from the final lse, so no
S x S matrix ever exists, in either pass.
"""

from __future__ import annotations

import math
from typing import Any

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
)
from polyshard.models.common.cores.plan import BlockPlan, block_hidden, plan_blocks

BLOCK = 256
"""Tokens per block a side: (B, N, 256, 256) float32 scores per step, large enough for matmuls to run
near their peak on a CPU, small enough to skip a short document's blocks."""


class _Mask:
    """What a plan's partial blocks are masked by (causal, window, documents)."""

    def __init__(self, causal: bool, window: int | None, segments: torch.Tensor | None):
        self.causal, self.window, self.segments = causal, window, segments

    def blocks(self, plan: BlockPlan, length: int, device: torch.device) -> Any:
        """(rows, cols, hidden or None) of each planned pair, hidden (:func:`block_hidden`) for partial ones."""
        size = plan.block
        for i, j, partial in plan.pairs:
            rows = slice(i * size, min((i + 1) * size, length))
            cols = slice(j * size, min((j + 1) * size, length))
            hidden = None
            if partial:
                hidden = block_hidden(
                    rows, cols, causal=self.causal, window=self.window, segments=self.segments, device=device
                )
            yield rows, cols, hidden


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
        mask: _Mask,
        plan: BlockPlan,
        scale: float,
    ) -> torch.Tensor:
        length, kv_heads = q.shape[2], k.shape[1]
        q32 = grouped_query(q.float(), kv_heads)  # (B, K, G, S, D)
        k32, v32 = grouped_kv(k.float()), grouped_kv(v.float())  # (B, K, 1, S, D), (B, K, 1, S, E)
        out = q32.new_zeros(q32.shape[:-1] + (v.shape[-1],))  # (B, K, G, S, E) float32
        lse = q32.new_full(q32.shape[:-1], float("-inf"))  # (B, K, G, S) float32
        for rows, cols, hidden in mask.blocks(plan, length, q.device):
            block_out, block_lse = block_forward(
                q32[..., rows, :], k32[..., cols, :], v32[..., cols, :], scale, False, hidden
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
        length, kv_heads = q.shape[2], k.shape[1]
        q32 = grouped_query(q.float(), kv_heads)
        k32, v32 = grouped_kv(k.float()), grouped_kv(v.float())
        dout32 = grouped_query(dout.float(), kv_heads)  # (B, K, G, S, E)
        delta = (dout32 * out).sum(dim=-1)  # rowsum(dO * O): (B, K, G, S)
        dq, dk, dv = torch.zeros_like(q32), torch.zeros_like(k32), torch.zeros_like(v32)
        for rows, cols, hidden in ctx.mask.blocks(ctx.plan, length, q.device):
            dq_b, dk_b, dv_b = block_backward(
                q32[..., rows, :],
                k32[..., cols, :],
                v32[..., cols, :],
                dout32[..., rows, :],
                lse[..., rows],
                delta[..., rows],
                ctx.scale,
                False,
                hidden,
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
) -> torch.Tensor:
    """Attention of (B, N, S, D) queries over (B, K, S, D) keys and (B, K, S, E) values of one whole
    sequence: (B, N, S, E) in q's dtype, computed in float32. ``causal``, ``window`` (tokens each query
    sees, itself included) and ``segments`` (B, S, each token's document) choose the visible keys;
    ``sinks`` (N,): one learned logit per head added to every softmax denominator (gpt-oss)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    plan = plan_blocks(q.shape[2], block, causal=causal, window=window, segments=segments)
    mask = _Mask(causal, window, segments)
    return BlockSparseAttention.apply(q, k, v, sinks, mask, plan, scale)  # type: ignore[no-untyped-call,no-any-return]
