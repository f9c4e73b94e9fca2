"""Ring attention: key/value blocks travel round the context-parallel group while every rank keeps
its own queries (Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers",
2310.01889), on the load-balanced layout of :mod:`polyshard.cp.sharding`.

Shapes: B batch, N query heads, K key/value heads (N a multiple of K), S = 2C local tokens (two
chunks of C), D query/key head dim, E value head dim; cp ranks in the group.

Forward (rank r, steps s = 0 .. cp-1): at step s the rank holds the keys and values of rank
src = (r - s) mod cp. Before computing, it posts the send of that block to rank r+1 and the
receive of the next one from rank r-1, so the transfer runs during the compute; it then computes
the (query chunk, key chunk) pairs :func:`~polyshard.cp.blocks.plan_blocks` lists and merges them into a
float32 (out, lse) accumulator with the log-sum-exp rule; then it waits for the next block. cp - 1
transfers of K and V (packed into one buffer) per rank. Inside a pair the work is block-sparse
(:mod:`polyshard.cp.blocksparse`): its queries and keys are cut into blocks of ``block`` tokens (256), and
only the (query block, key block) pairs that hold a visible key are computed, each merged into the same
accumulator; the blocks above the causal diagonal, outside a window or between two documents are never
touched, and the largest score matrix is block x block, not C x C.

Backward: the same ring again, with the K/V blocks re-sent (the forward keeps only q, k, v, out, lse
and its plans, not the blocks it received or any attention matrix). Each planned block's
probabilities are recomputed from the saved lse; dQ accumulates locally, while the float32 dK/dV of
the block a rank holds travels with it: rank r adds its contribution to the partial sum received from
rank r-1 and passes it on to rank r+1. After cp steps each partial sum has visited every rank and one last
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

Each rank computes two diagonal and three full C x C pairs: the same work on both ranks (each pair
then walked in blocks of ``block`` tokens, the diagonal pairs' blocks above the diagonal skipped).

Document masking (``segments``, each local token's document within its row): the block's document
ids travel with its K/V (a second, small int64 transfer in the same exchange). Each pair's plan judges
its key/value blocks by their documents: a (query block, key block) whose documents do not overlap is
skipped, one inside a single shared document runs unmasked, and the rest get a block x block mask. The
forward keeps every step's plan, so the backward needs no extra transfer and computes exactly the blocks
the forward did.

Sliding windows (``window``, causal only): a chunk pair whose keys all lie ``window`` or more tokens
before its first query is skipped whole (:func:`~polyshard.cp.blocks.plan_blocks`), and inside a pair so
is every key block wholly outside the window; a block the window cuts into is masked by it.

Sinks (``sinks``, one logit per query head): folded into the final (out, lse) once, after the last step,
as a block with output 0; the backward's probabilities are recomputed from that lse, and each rank's
sink gradient comes from its own query rows.

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
    add_sinks,
    block_backward,
    block_forward,
    fused_available,
    grouped_kv,
    grouped_query,
    merge_into,
    plan_blocks,
    sink_gradient,
    ungrouped,
)
from polyshard.cp.blocksparse import BLOCK, BlockPlan, Visibility, plan_sparse_blocks

Pair = tuple[slice, slice, Visibility, BlockPlan]
"""One (query chunk, key chunk) pair a step computes: its local query rows and key rows, what each query
sees there, and the key/value blocks inside it that hold a visible key."""


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
        block: int = BLOCK,
    ) -> torch.Tensor:
        ring = _Ring(group)
        q32 = grouped_query(q.float(), k.shape[1])  # (B, K, G, S, D)
        if segments is None and window is None and fused_available(q32, k, v, None):
            # the fused kernel tiles a chunk pair itself: one call and one merge a pair (2,048 tokens a chunk:
            # 0.56 of one process's SDPA against 0.73 in blocks of 256, `polyshard.bench.cp`)
            block = max(block, q.shape[2])
        out = q32.new_zeros(q32.shape[:-1] + (v.shape[-1],))  # (B, K, G, S, E) float32
        lse = q32.new_full(q32.shape[:-1], float("-inf"))  # (B, K, G, S) float32
        travelling = [_pack(k, v)] if segments is None else [_pack(k, v), segments]  # K/V in the inputs' dtype
        plans = []  # each step's pairs and blocks, kept for the backward (which then needs no document ids)
        for step in range(ring.size):
            pending, incoming = ring.pass_on(*travelling) if step < ring.size - 1 else (None, travelling)
            k_block, v_block = (grouped_kv(t.float()) for t in _unpack(travelling[0], k.shape, v.shape))
            key_segments = travelling[1] if segments is not None else None
            plans.append(_plan_step(ring, step, q.shape[2], causal, window, segments, key_segments, block))
            for rows, cols, seen, plan in plans[-1]:
                q_rows, k_cols, v_cols = q32[..., rows, :], k_block[..., cols, :], v_block[..., cols, :]
                _forward_pair(q_rows, k_cols, v_cols, seen, plan, scale, out[..., rows, :], lse[..., rows])
            if pending is not None:
                pending.wait()
            travelling = incoming
        if sinks is not None:  # each head's sink joins every row's denominator once, after all blocks
            add_sinks(out, lse, sinks.float())
        # The float32 output, not the returned one: with bf16 inputs, rowsum(dO * O) in the backward
        # would otherwise start from a rounded O. For float32 inputs they are the same tensor.
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.scale, ctx.plans = group, scale, plans
        return ungrouped(out).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ring, scale = _Ring(ctx.group), ctx.scale
        kv_heads = k.shape[1]
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
            for rows, cols, seen, plan in ctx.plans[step]:  # the forward's pairs and blocks, no others
                _backward_pair(
                    (q32[..., rows, :], k_block[..., cols, :], v_block[..., cols, :]),
                    (dout32[..., rows, :], out[..., rows, :], lse[..., rows], delta[..., rows]),
                    seen,
                    plan,
                    scale,
                    (dq[..., rows, :], dk[..., cols, :], dv[..., cols, :]),
                )
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
        return dq_out, dk_own.to(k.dtype), dv_own.to(v.dtype), None, None, None, None, None, dsinks, None


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
    *,
    block: int = BLOCK,
) -> torch.Tensor:
    """Ring attention of local (B, N, S, D) queries over (B, K, S, D) keys and (B, K, S, E) values
    of a sequence sharded by :func:`~polyshard.cp.sharding.shard_sequence`: (B, N, S, E). ``segments``
    (B, S): the local tokens' documents, sharded alike; attention then stays inside each document.
    ``window``: each query sees its last ``window`` tokens only; ``sinks`` (N,): per-head sink logits.
    ``block``: tokens a side of the key/value blocks each chunk pair is walked in (the last may be shorter);
    with no documents or window on a CPU, where every block runs the fused kernel, a chunk pair is one block."""
    return RingAttention.apply(q, k, v, group, causal, scale, segments, window, sinks, block)  # type: ignore[no-untyped-call,no-any-return]


def _plan_step(
    ring: _Ring,
    step: int,
    local: int,
    causal: bool,
    window: int | None,
    segments: torch.Tensor | None,
    key_segments: torch.Tensor | None,
    block: int,
) -> list[Pair]:
    """The chunk pairs this rank computes at ``step`` (:func:`~polyshard.cp.blocks.plan_blocks`) and, in
    each, the key/value blocks that hold a key some query sees
    (:func:`~polyshard.cp.blocksparse.plan_sparse_blocks`). Positions are the pair's own: its keys start
    at 0 and its queries ``offset`` later, all a causal mask and a window need. ``local``: this rank's 2C
    tokens; ``segments`` and ``key_segments`` (B, 2C): the queries' and the keys' documents."""
    pairs = []
    for pair in plan_blocks(ring.rank, ring.source(step), ring.size, local // 2, causal, window):
        seen = Visibility(
            causal,
            window,
            None if segments is None else segments[:, pair.rows],
            None if key_segments is None else key_segments[:, pair.cols],
            query_start=pair.offset,
        )
        queries, keys = len(range(local)[pair.rows]), len(range(local)[pair.cols])
        plan = plan_sparse_blocks(queries, keys, block, seen)
        if plan.pairs:  # a pair whose queries and keys share no document: nothing at all
            pairs.append((pair.rows, pair.cols, seen, plan))
    return pairs


def _forward_pair(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: Visibility,
    plan: BlockPlan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge each planned block of one chunk pair into the running (out, lse) of its query rows (views of
    the step-spanning accumulators: the log-sum-exp merge does not care which step or block came first)."""
    for rows, cols, hidden, diagonal in seen.blocks(plan, q.shape[-2], k.shape[-2], q.device):
        block_out, block_lse = block_forward(q[..., rows, :], k[..., cols, :], v[..., cols, :], scale, diagonal, hidden)
        merge_into(out[..., rows, :], lse[..., rows], block_out, block_lse, masked=hidden is not None)


def _backward_pair(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    seen: Visibility,
    plan: BlockPlan,
    scale: float,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Add each planned block's dQ, dK, dV of one chunk pair into ``grads`` (views of dq, dk, dv);
    ``rows_state``: the pair's query rows of dout, the final out, lse and delta."""
    (q, k, v), (dout, out, lse, delta), (dq, dk, dv) = qkv, rows_state, grads
    for rows, cols, hidden, diagonal in seen.blocks(plan, q.shape[-2], k.shape[-2], q.device):
        dq_b, dk_b, dv_b = block_backward(
            q[..., rows, :],
            k[..., cols, :],
            v[..., cols, :],
            dout[..., rows, :],
            lse[..., rows],
            delta[..., rows],
            scale,
            diagonal,
            hidden,
            out[..., rows, :],
        )
        dq[..., rows, :] += dq_b
        dk[..., cols, :] += dk_b
        dv[..., cols, :] += dv_b
