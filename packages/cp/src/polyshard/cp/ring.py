"""Ring attention: key/value blocks travel round the context-parallel group while every rank keeps
its own queries (Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers",
2310.01889), on the load-balanced layout of :mod:`polyshard.cp.sharding`.

Shapes: B batch, N query heads, K key/value heads (N a multiple of K), S = 2C local tokens (two
chunks of C), D query/key head dim, E value head dim; cp ranks in the group.

Forward (rank r, steps s = 0 .. cp-1): at step s the rank holds the keys and values of rank
src = (r - s) mod cp. Before computing, it posts the send of that block to rank r+1 and the
receive of the next one from rank r-1, so the transfer runs during the compute; it then computes
the blocks :func:`~polyshard.cp.blocks.plan_blocks` lists and merges each into a float32
(out, lse) accumulator with the log-sum-exp rule; then it waits for the next block. cp - 1
transfers of K and V (packed into one buffer) per rank.

Backward: the same ring again, with the K/V blocks re-sent (the forward keeps only q, k, v, out and
lse, not the blocks it received or any attention matrix). Each block's probabilities are recomputed
from the saved lse; dQ accumulates locally, while the float32 dK/dV of the block a rank holds
travels with it: rank r adds its contribution to the partial sum received from rank r-1 and
passes it on to rank r+1. After cp steps each partial sum has visited every rank and one last
hop brings it home. cp - 1 K/V transfers and cp dK/dV transfers per rank; each dK/dV transfer
is posted when its block is done and waited for one step later, behind the next block's compute.

Worked example, cp=2, S=8 tokens (C=2): rank 0 holds chunks 0 and 3 (positions 0 1 6 7), rank 1
chunks 1 and 2 (positions 2 3 4 5). Causal; "q3 x k0 full" means the queries of chunk 3 against
the keys of chunk 0, all visible; "diag" means the causal triangle; "skip" is never computed::

    forward   rank 0 (q0, q3)                    rank 1 (q1, q2)
    step 0    own K/V (k0, k3):                   own K/V (k1, k2):
              q0 x k0 diag, q3 x k0 full,         q1 x k1 diag, q2 x k1 full,
              q3 x k3 diag, q0 x k3 skip          q2 x k2 diag, q1 x k2 skip
              meanwhile: send (k0, k3) -> 1       meanwhile: send (k1, k2) -> 0
    step 1    K/V of rank 1 (k1, k2):             K/V of rank 0 (k0, k3):
              q3 x k1 full, q3 x k2 full,         q1 x k0 full, q2 x k0 full,
              q0 x k1 skip, q0 x k2 skip          q1 x k3 skip, q2 x k3 skip

Each rank computes two diagonal and three full C x C blocks: the same work on both ranks.

Document masking (``segments``, each local token's document within its row): the block's document
ids travel with its K/V (a second, small int64 transfer in the same exchange); the forward keeps the
ids of every block it saw, so the backward needs no extra transfer. A block whose queries and keys
share no document is skipped in both passes; the others are masked (:mod:`polyshard.cp.blocks`).

Sliding windows (``window``, causal only): a block whose keys all lie ``window`` or more tokens before
its first query is skipped in both passes (:func:`~polyshard.cp.blocks.plan_blocks`); a block the window
cuts into is masked by it. Sinks (``sinks``, one logit per query head): folded into the final (out, lse)
once, after the last step, as a block with output 0; the backward's probabilities are recomputed from
that lse, and each rank's sink gradient comes from its own query rows.

    backward  rank 0                              rank 1
    step 0    own blocks -> dQ, and dK/dV of      own blocks -> dQ, and dK/dV of
              (k0, k3) so far; send it -> 1       (k1, k2) so far; send it -> 0
    step 1    blocks of rank 1's K/V -> dQ, and   blocks of rank 0's K/V -> dQ, and
              add to rank 1's dK/dV; send -> 1    add to rank 0's dK/dV; send -> 0
    end       receives the full dK/dV of (k0, k3) receives the full dK/dV of (k1, k2)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from polyshard.collectives import PendingExchange, post_exchange
from polyshard.collectives.ledger import group_ranks
from polyshard.cp.blocks import (
    Block,
    add_sinks,
    block_backward,
    block_forward,
    grouped_kv,
    grouped_query,
    hidden_keys,
    merge_into,
    plan_blocks,
    sink_gradient,
    ungrouped,
)


def _pack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One flat buffer holding ``a`` then ``b`` (same dtype), so a block travels as one transfer."""
    return torch.cat([a.reshape(-1), b.reshape(-1)])


def _unpack(flat: torch.Tensor, a_shape: torch.Size, b_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    a_numel = a_shape.numel()
    return flat[:a_numel].view(a_shape), flat[a_numel:].view(b_shape)


class _Ring:
    """This rank's place in the ring: position, size and the global ranks of its two neighbours."""

    def __init__(self, group: dist.ProcessGroup | None):
        ranks = group_ranks(group)
        self.group, self.size, self.rank = group, len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def source(self, step: int) -> int:
        """Group rank whose K/V block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def pass_on(self, *blocks: torch.Tensor) -> tuple[PendingExchange, list[torch.Tensor]]:
        """Post: send ``blocks`` to the next rank, receive the previous rank's into new buffers."""
        buffers = [torch.empty_like(block) for block in blocks]
        sends, recvs = [(block, self.next) for block in blocks], [(buffer, self.prev) for buffer in buffers]
        return post_exchange(sends=sends, recvs=recvs, group=self.group), buffers


class RingAttention(torch.autograd.Function):
    """forward: attention of the local queries over every rank's keys, K/V passed round the ring /
    backward: recompute per block from the saved lse, dK/dV passed round the ring back to their owners.

    See the module docstring for the algorithm and a worked example for cp=2.
    """

    @staticmethod
    def forward(
        ctx: Any,
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
        ring = _Ring(group)
        chunk = q.shape[2] // 2
        q32 = grouped_query(q.float(), k.shape[1])  # (B, K, G, S, D)
        out = q32.new_zeros(q32.shape[:-1] + (v.shape[-1],))  # (B, K, G, S, E) float32
        lse = q32.new_full(q32.shape[:-1], float("-inf"))  # (B, K, G, S) float32
        travelling = [_pack(k, v)] if segments is None else [_pack(k, v), segments]  # K/V in the inputs' dtype
        seen = []  # the document ids of each step's keys (B, S), kept for the backward
        for step in range(ring.size):
            pending, incoming = ring.pass_on(*travelling) if step < ring.size - 1 else (None, travelling)
            k_block, v_block = (grouped_kv(t.float()) for t in _unpack(travelling[0], k.shape, v.shape))
            key_segments = travelling[1] if segments is not None else None
            seen += travelling[1:]
            for block in plan_blocks(ring.rank, ring.source(step), ring.size, chunk, causal, window):
                rows, cols, diagonal = block.rows, block.cols, block.diagonal
                compute, hidden = _hidden(block, window, segments, key_segments, q.device)
                if not compute:
                    continue
                q_rows, k_cols, v_cols = q32[..., rows, :], k_block[..., cols, :], v_block[..., cols, :]
                block_out, block_lse = block_forward(q_rows, k_cols, v_cols, scale, diagonal, hidden)
                merge_into(out[..., rows, :], lse[..., rows], block_out, block_lse, masked=hidden is not None)
            if pending is not None:
                pending.wait()
            travelling = incoming
        if sinks is not None:  # each head's sink joins every row's denominator once, after all blocks
            add_sinks(out, lse, sinks.float())
        # The float32 output, not the returned one: with bf16 inputs, rowsum(dO * O) in the backward
        # would otherwise start from a rounded O. For float32 inputs they are the same tensor.
        ctx.save_for_backward(q, k, v, out, lse, sinks, *([torch.stack(seen)] if seen else []))
        ctx.group, ctx.causal, ctx.scale, ctx.window = group, causal, scale, window
        return ungrouped(out).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks, *seen = ctx.saved_tensors
        ring, causal, scale, window = _Ring(ctx.group), ctx.causal, ctx.scale, ctx.window
        segments = seen[0][0] if seen else None  # (B, S): step 0's keys are this rank's own tokens
        chunk, kv_heads = q.shape[2] // 2, k.shape[1]
        q32 = grouped_query(q.float(), kv_heads)
        dout32 = grouped_query(dout.float(), kv_heads)  # (B, K, G, S, E)
        delta = (dout32 * out).sum(dim=-1)  # rowsum(dO * O): (B, K, G, S)
        dq = torch.zeros_like(q32)
        kv = _pack(k, v)
        dkv_pending: PendingExchange | None = None
        dkv_incoming = torch.empty(0)
        for step in range(ring.size):
            kv_pending, kv_incoming = ring.pass_on(kv) if step < ring.size - 1 else (None, [kv])
            k_block, v_block = (grouped_kv(t.float()) for t in _unpack(kv, k.shape, v.shape))
            dk = torch.zeros_like(k_block)  # (B, K, 1, S, D): this block's dK, this rank's part
            dv = torch.zeros_like(v_block)
            key_segments = seen[0][step] if seen else None
            for block in plan_blocks(ring.rank, ring.source(step), ring.size, chunk, causal, window):
                rows, cols, diagonal = block.rows, block.cols, block.diagonal
                compute, hidden = _hidden(block, window, segments, key_segments, q.device)
                if not compute:  # skipped in the forward too
                    continue
                dq_b, dk_b, dv_b = block_backward(
                    q32[..., rows, :],
                    k_block[..., cols, :],
                    v_block[..., cols, :],
                    dout32[..., rows, :],
                    lse[..., rows],
                    delta[..., rows],
                    scale,
                    diagonal,
                    hidden,
                )
                dq[..., rows, :] += dq_b
                dk[..., cols, :] += dk_b
                dv[..., cols, :] += dv_b
            dkv = _pack(dk, dv)  # float32: partial sums keep full precision on their way round
            if dkv_pending is not None:
                dkv_pending.wait()  # the ranks before this one in the ring: their part of this block's dK/dV
                dkv += dkv_incoming
            if ring.size > 1:  # pass this block's dK/dV on; the last hop takes it home
                dkv_pending, (dkv_incoming,) = ring.pass_on(dkv)
            if kv_pending is not None:
                kv_pending.wait()
            (kv,) = kv_incoming
        if dkv_pending is not None:
            dkv_pending.wait()
            dkv = dkv_incoming
        dk_own, dv_own = _unpack(dkv, k.shape, v.shape)
        # The sinks' gradient from this rank's query rows; the trainer sums it over cp like any replica's.
        dsinks = None if sinks is None else sink_gradient(sinks.float(), lse, delta).to(sinks.dtype)
        dq_out = ungrouped(dq).to(q.dtype)
        return dq_out, dk_own.to(k.dtype), dv_own.to(v.dtype), None, None, None, None, None, dsinks


def ring_attention(
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
    """Ring attention of local (B, N, S, D) queries over (B, K, S, D) keys and (B, K, S, E) values
    of a sequence sharded by :func:`~polyshard.cp.sharding.shard_sequence`: (B, N, S, E). ``segments``
    (B, S): the local tokens' documents, sharded alike; attention then stays inside each document.
    ``window``: each query sees its last ``window`` tokens only; ``sinks`` (N,): per-head sink logits."""
    return RingAttention.apply(q, k, v, group, causal, scale, segments, window, sinks)  # type: ignore[no-untyped-call,no-any-return]


def _hidden(
    block: Block,
    window: int | None,
    segments: torch.Tensor | None,
    key_segments: torch.Tensor | None,
    device: torch.device,
) -> tuple[bool, torch.Tensor | None]:
    """(whether to compute the block, its mask) from this rank's and the block's document ids."""
    query_rows = None if segments is None else segments[:, block.rows]
    key_cols = None if key_segments is None else key_segments[:, block.cols]
    return hidden_keys(block, window, query_rows, key_cols, device)
