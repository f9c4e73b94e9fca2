"""The entry points: :func:`context_parallel_attention` and :class:`ContextParallelAttention`, a
drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on sequence-sharded tensors.

Shapes: B batch, N query heads, K key/value heads (N a multiple of K: grouped-query attention),
S = 2C local tokens (this rank's two chunks from :func:`~polyshard.cp.sharding.shard_sequence`),
D query/key head dim, E value head dim.

An attention layer that calls SDPA swaps it for this module and changes nothing else, provided
its input tokens were sharded with ``shard_sequence`` and its rotary positions came from
``position_ids``::

    core = ContextParallelAttention(mesh.group("cp"))              # style="ring", "allgather" or "ulysses"
    y = core(q, k, v, is_causal=True)                             # instead of F.scaled_dot_product_attention

Packed rows of several documents (document masking): pass ``segments``, each local token's document
index within its row (B, S), sharded with ``shard_sequence`` like the tokens; attention then stays
inside each document, and blocks of keys no query may see are skipped.

The 2-D scheme (``style="ulysses+ring"``): ``group`` is the all-to-all (Ulysses) group of neighbouring
cp ranks and ``ring_group`` the ranks of the same Ulysses index (:func:`~polyshard.cp.groups.ulysses_ring_groups`
makes both); the tokens are sharded over the whole cp group as for the other styles.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import eager
from polyshard.cp.allgather import allgather_attention
from polyshard.cp.errors import ContextParallelError
from polyshard.cp.ring import ring_attention
from polyshard.cp.ulysses import sdpa_core, ulysses_attention
from polyshard.mesh import divisors

Style = Literal["ring", "allgather", "ulysses", "ulysses+ring"]
STYLES: tuple[str, ...] = get_args(Style)


def check_segments(q: torch.Tensor, segments: torch.Tensor) -> None:
    """Document ids must be integers, one per local token of each row."""
    if segments.dtype.is_floating_point or segments.shape != (q.shape[0], q.shape[2]):
        raise ContextParallelError(
            f"segments must hold an integer document index per local token, shape (B, S_local) = "
            f"{(q.shape[0], q.shape[2])}; got {segments.dtype} of shape {tuple(segments.shape)}: shard the rows' "
            "document ids with shard_sequence(segments, 1, group) as the tokens are"
        )


def check_window_and_sinks(q: torch.Tensor, causal: bool, window: int | None, sinks: torch.Tensor | None) -> None:
    """A window needs causal attention and at least the query itself; sinks are one number per query head."""
    if window is not None and (not causal or window < 1):
        raise ContextParallelError(
            f"window={window}: a sliding window needs causal attention and at least 1 token (the query itself)"
        )
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ContextParallelError(
            f"sinks must hold one logit per query head, shape ({q.shape[1]},); got {tuple(sinks.shape)}"
        )


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, style: str) -> None:
    """Raise :class:`ContextParallelError` for inputs this rank can tell are wrong. (Every rank must
    also hold the same shapes; checking that would cost a collective per call, so it is not done.)"""
    if style not in STYLES:
        raise ContextParallelError(f"style={style!r} is unknown; choose one of {STYLES}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ContextParallelError(
            f"q, k and v must be 4-D (B, heads, S_local, head_dim); got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)} and {tuple(v.shape)}: transpose (B, S, heads, head_dim) inputs with .transpose(1, 2)"
        )
    (b, n, s, d), (bk, nk, sk, dk), (bv, nv, sv, _) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise ContextParallelError(f"q, k and v must share the batch size; got {b}, {bk} and {bv}")
    if nk != nv or nk == 0 or n % nk:
        raise ContextParallelError(
            f"q has {n} heads, k {nk} and v {nv}: k and v need the same number of heads, and it must divide "
            f"the query heads (grouped-query attention); choose key/value heads in {divisors(n)}"
        )
    if not s == sk == sv:
        raise ContextParallelError(
            f"q, k and v must hold the same local tokens (self-attention on shard_sequence chunks); "
            f"got local sequence lengths {s}, {sk} and {sv}"
        )
    if s % 2:
        raise ContextParallelError(
            f"local sequence length {s} is odd: each rank holds two equal chunks; shard a sequence whose "
            "length is divisible by 2*cp with shard_sequence and pass the result"
        )
    if d != dk:
        raise ContextParallelError(f"q and k must share the head dim; got {d} and {dk}")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ContextParallelError(
            f"q, k and v must share dtype and device; got {q.dtype}/{q.device}, {k.dtype}/{k.device}, "
            f"{v.dtype}/{v.device}"
        )


@eager  # a graph break under torch.compile: the ring's sends and receives run eagerly
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    causal: bool = True,
    style: Style = "ring",
    scale: float | None = None,
    segments: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    ring_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence held by ``group`` (None: the world).

    ``q`` (B, N, S, D), ``k`` (B, K, S, D), ``v`` (B, K, S, E) are this rank's chunks as
    :func:`~polyshard.cp.sharding.shard_sequence` lays them out; returns this rank's (B, N, S, E)
    output in the same layout, equal to ``scaled_dot_product_attention(..., is_causal=causal,
    enable_gqa=True)`` on the full sequence followed by ``shard_sequence``. ``scale`` defaults to
    1/sqrt(D). ``style="ring"`` passes K/V round the group; ``"allgather"`` gathers them once;
    ``"ulysses"`` turns the sequence split into a head split with all-to-alls around SDPA (the heads must
    divide over the group, :func:`~polyshard.cp.ulysses.kv_copies`); ``"ulysses+ring"`` does that over
    ``group`` and runs ring attention over ``ring_group`` on its heads (see the module docstring).
    Gradients flow to q, k and v (each rank gets those of its own chunks). ``segments`` (B, S) int:
    the local tokens' documents (non-decreasing along each full row), sharded like q; a query then
    sees only keys of its own document (and, causal, not after it), and fully masked blocks are skipped.
    ``window`` (causal only): each query sees only its last ``window`` tokens, itself included (Mistral's,
    gpt-oss's and Hugging Face's ``sliding_window``); blocks wholly outside it are skipped. ``sinks`` (N,):
    a learned logit per query head in every softmax denominator, adding no value (gpt-oss).
    """
    check_inputs(q, k, v, style)
    if segments is not None:
        check_segments(q, segments)
    check_window_and_sinks(q, causal, window, sinks)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if style == "ring":
        return ring_attention(q, k, v, group, causal, scale, segments, window, sinks)
    if style == "allgather":
        return allgather_attention(q, k, v, group, causal, scale, segments, window, sinks)
    if style == "ulysses":
        if window is not None or sinks is not None:
            raise ContextParallelError(
                "style='ulysses' here runs plain SDPA, which has no window or sinks: call "
                "polyshard.cp.ulysses_attention with a core that has them (the trainer passes the model's own), "
                "or use style 'ring', 'allgather' or 'ulysses+ring'"
            )
        return ulysses_attention(q, k, v, group, sdpa_core(causal=causal, scale=scale), segments)
    if ring_group is None:
        raise ContextParallelError(
            "style='ulysses+ring' needs ring_group, the ranks that share this rank's Ulysses index "
            "(polyshard.cp.ulysses_ring_groups makes it and group)"
        )

    def ring(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, every: torch.Tensor | None, heads_sinks: torch.Tensor | None
    ) -> torch.Tensor:
        return ring_attention(q, k, v, ring_group, causal, scale, every, window, heads_sinks)

    return ulysses_attention(q, k, v, group, ring, segments, sinks)


class ContextParallelAttention(nn.Module):
    """``scaled_dot_product_attention`` for sequence-sharded q, k, v over a context-parallel group.

    Takes SDPA's arguments, so an attention layer can hold it as its inner product. ``attn_mask``
    and ``dropout_p > 0`` are refused (the only masks are causal or none, following the
    load-balanced layout; for packed documents pass ``segments`` instead, see
    :func:`context_parallel_attention`); fewer key/value heads always work, so ``enable_gqa`` is
    accepted and needs not be set.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        style: Style = "ring",
        ring_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        if style not in STYLES:
            raise ContextParallelError(f"style={style!r} is unknown; choose one of {STYLES}")
        self.group, self.style, self.ring_group = group, style, ring_group

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        *,
        segments: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_mask is not None:
            raise ContextParallelError(
                "ContextParallelAttention takes no attn_mask: each rank holds two chunks of the sequence, so "
                "a mask over the full sequence does not apply; pass is_causal=True for causal attention"
            )
        if dropout_p != 0.0:
            raise ContextParallelError(
                f"dropout_p={dropout_p}: attention-probability dropout is not supported under context "
                "parallelism; set the attention dropout to 0"
            )
        return context_parallel_attention(
            query,
            key,
            value,
            self.group,
            causal=is_causal,
            style=self.style,
            scale=scale,
            segments=segments,
            window=window,
            sinks=sinks,
            ring_group=self.ring_group,
        )

    def extra_repr(self) -> str:
        if self.ring_group is None:
            return f"style={self.style!r}, cp={dist.get_world_size(self.group)}"
        return f"style={self.style!r}, cp={dist.get_world_size(self.group)}x{dist.get_world_size(self.ring_group)}"
