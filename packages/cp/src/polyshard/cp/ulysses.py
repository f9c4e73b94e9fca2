"""Ulysses attention: an all-to-all turns sequence shards into head shards, any attention core runs on
whole sequences of a few heads, and a second all-to-all turns its output back (DeepSpeed-Ulysses,
Jacobs et al. 2309.14509). With a ring group as well, the core is ring attention over that group: the
2-D scheme of USP (Fang and Zhao 2405.07719) and Megatron-LM's ``a2a+p2p``.

Shapes: B batch, N query heads, K key/value heads, S = 2C local tokens (two load-balanced chunks,
:mod:`polyshard.cp.sharding`), u ranks in the all-to-all group, D query/key and E value head dims.

Forward: q (B, N, S, D) -> (B, N/u, uS, D): rank i keeps query heads [i N/u, (i+1) N/u) and receives
them for every rank's tokens. The u ranks' chunks arrive in rank order (chunks 0, 2u-1, 1, 2u-2, ...)
and are put in sequence order, so the core sees its tokens in order: a causal mask and the document
ids (all-gathered alike) mean what they mean on one process. k and v go the same way with their own
head dims. Backward: the reverse all-to-alls (each the other's adjoint), and autograd through the core.

Key/value heads: rank i keeps kv heads [i K/u, (i+1) K/u), the ones its query heads read (grouped-query
attention splits both into contiguous ranges), which needs K divisible by u; with fewer kv heads than
u (u a multiple of K) each kv head is first repeated u/K times, as tensor parallelism replicates them
(polyshard.tp.heads), and the copies' gradients sum back on the way out.

Worked example, u=2, 4 query heads, 2 kv heads, S=8 (C=2): rank 0 holds positions [0 1 6 7] of every
head, rank 1 [2 3 4 5]. After the all-to-all rank 0 holds heads 0-1 (kv head 0) at positions
[0 1 6 7 | 2 3 4 5] (rank order), reordered to 0..7; rank 1 heads 2-3 (kv head 1), likewise. Each runs
the causal core on 8 tokens of its 2 heads; the output's all-to-all sends positions [2 3 4 5] of heads
0-1 to rank 1 and receives positions [0 1 6 7] of heads 2-3 from it.

2-D, cp = u x r ranks, cp rank c = j u + i (ring index j, Ulysses index i; Ulysses groups are
neighbouring cp ranks): the u ranks of ring index j hold the 2cp chunks ju .. ju+u-1 and
2cp-u(j+1) .. 2cp-1-ju, i.e. exactly chunks j and 2r-1-j of a 2r-chunk split. After the all-to-all
and the same reordering each holds those two ring chunks, in order: the ring's own layout, so
:func:`~polyshard.cp.ring.ring_attention` runs unchanged over the ring group on N/u heads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.collectives import all_to_all, eager, ops
from polyshard.cp.errors import ContextParallelError
from polyshard.cp.sharding import to_rank_order, to_sequence_order
from polyshard.mesh import divisors

Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]
"""An attention core on whole sequences in order: (q (B, n, T, D), k (B, k, T, D), v (B, k, T, E),
segments (B, T) or None, sinks (n,) or None) -> (B, n, T, E), causal or windowed as the caller built it."""


def kv_copies(num_heads: int, num_kv_heads: int, ulysses: int) -> int:
    """How many times each kv head is repeated before the all-to-all (1: none); a
    :class:`ContextParallelError` naming the sizes that work when the heads do not split over ``ulysses``."""
    kv_fits = num_kv_heads % ulysses == 0 or ulysses % num_kv_heads == 0
    if num_heads % ulysses or not kv_fits:
        valid = [d for d in divisors(num_heads) if num_kv_heads % d == 0 or d % num_kv_heads == 0]
        raise ContextParallelError(
            f"Ulysses splits the heads over {ulysses} ranks, but this rank holds {num_heads} query and "
            f"{num_kv_heads} key/value heads (after tensor parallelism): the query heads must divide by it and "
            f"the key/value heads divide by it or it by them; choose the Ulysses size in {valid}, or use "
            "cp_style 'ulysses+ring' with cp_ulysses in that set (or 'ring')"
        )
    return max(1, ulysses // num_kv_heads)


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, H, S, D) local tokens of every head -> (B, H/u, uS, D) every rank's tokens, in sequence order,
    of this rank's heads. Differentiable (the backward is :func:`heads_to_sequence`'s forward)."""
    u = dist.get_world_size(group)
    rows = x.reshape(x.shape[0], u, x.shape[1] // u, *x.shape[2:]).movedim(
        1, 0
    )  # (u, B, H/u, S, D): row j goes to rank j
    received = all_to_all(rows.contiguous(), [1] * u, [1] * u, group)  # row j: rank j's tokens
    gathered = received.movedim(0, 2).flatten(2, 3)  # (B, H/u, u, S, D) -> (B, H/u, uS, D), rank order
    return to_sequence_order(gathered, 2, u)


def heads_to_sequence(y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, H/u, uS, E) this rank's heads over the sequence in order -> (B, H, S, E) every head on this
    rank's tokens: the inverse of :func:`sequence_to_heads`."""
    u = dist.get_world_size(group)
    ranked = to_rank_order(y, 2, u)
    rows = ranked.reshape(*ranked.shape[:2], u, -1, ranked.shape[-1]).movedim(
        2, 0
    )  # (u, B, H/u, S, E): row j -> rank j
    received = all_to_all(rows.contiguous(), [1] * u, [1] * u, group)  # row j: rank j's heads, my tokens
    return received.movedim(0, 1).flatten(1, 2)  # (B, u, H/u, S, E) -> (B, H, S, E)


@eager  # a graph break under torch.compile, as the ring's: its collectives and the core between them run eagerly
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    core: Core,
    segments: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of local (B, N, S, D) queries over (B, K, S, D) keys and (B, K, S, E) values of a
    sequence sharded over ``group`` by :func:`~polyshard.cp.sharding.shard_sequence`: ``core`` runs on
    this rank's N/u heads of the whole sequence, in order; returns (B, N, S, E) in the local layout.
    ``segments`` (B, S): the local tokens' documents, sharded alike; they are gathered for the core.
    ``core`` may itself be context parallel over another group (the 2-D scheme: see the module docstring).
    ``sinks`` (N,): the heads' sink logits; the core gets those of this rank's N/u heads."""
    u = dist.get_world_size(group)
    if u == 1:
        return core(q, k, v, segments, sinks)
    copies = kv_copies(q.shape[1], k.shape[1], u)
    if copies > 1:  # fewer kv heads than ranks: kv head h becomes copies u/K h .. u/K (h+1) - 1
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    every = None if segments is None else to_sequence_order(ops.all_gather(segments, 1, group), 1, u)  # (B, uS)
    if sinks is not None:  # this rank's query heads: [i N/u, (i+1) N/u)
        sinks = sinks.chunk(u)[dist.get_rank(group)]
    out = core(sequence_to_heads(q, group), sequence_to_heads(k, group), sequence_to_heads(v, group), every, sinks)
    return heads_to_sequence(out, group)


def sdpa_core(*, causal: bool, scale: float | None = None) -> Core:
    """The plain core: ``scaled_dot_product_attention`` on whole sequences, causal or not; with
    ``segments`` an explicit mask keeps each query inside its document (dense (B, 1, T, T) booleans:
    models bring their own, lighter core)."""

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor | None, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        if sinks is not None:
            raise ContextParallelError("sdpa_core has no sinks; pass a core that has them to ulysses_attention")
        gqa = q.shape[1] != k.shape[1]
        if segments is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        visible = segments[:, None, :, None] == segments[:, None, None, :]  # (B, 1, T, T): same document
        if causal:
            visible = visible & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)

    return attend
