"""Which (query block, key block) pairs of one sequence attention must compute, and the mask of those it
computes only in part: the plan of the block-sparse core (:mod:`.blocksparse`).

Shapes: B batch, S sequence, Q query rows and T key rows of one block, n = ceil(S / block) blocks a side.

A key is visible to a query when all of these hold: ``causal``, it is not later; ``window`` W, it is one
of the W tokens ending at the query (positions q - W < k <= q, Hugging Face's ``sliding_window``);
``segments`` (B, S), it is in the query's document. A block pair is *skipped* when no (query, key) pair
in it is visible in any row, *full* when every pair is (no mask needed), and *partial* otherwise.
Documents are judged from each block's smallest and largest document index: two blocks share no
document when those ranges do not overlap (rows are non-decreasing, so this is exact for them).

S = 8, block 2, causal, one document [0 0 0 1 1 1 1 1] (x: full, m: partial, .: skipped)::

    key block    0 1 2 3
    query 0      m . . .        query 1 (positions 2, 3) sees key 2 of block 1 but not key 3
    query 1      m m . .        (another document, and the diagonal's later key)
    query 2      . m m .
    query 3      . m x m
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from polyshard.cp.blocks import window_hidden


class BlockPlan(NamedTuple):
    """The block pairs to compute, (query block, key block, partial) in query-block order, out of
    ``total`` = n x n pairs; ``block`` tokens a side (the last block of each side may be shorter)."""

    block: int
    pairs: list[tuple[int, int, bool]]
    total: int

    @property
    def skipped(self) -> int:
        """Block pairs never computed (no visible key in them): the work and memory the mask saves."""
        return self.total - len(self.pairs)


def plan_blocks(
    length: int, block: int, *, causal: bool, window: int | None = None, segments: torch.Tensor | None = None
) -> BlockPlan:
    """The :class:`BlockPlan` of a ``length``-token sequence cut into blocks of ``block`` tokens."""
    n = -(-length // block)
    first = torch.arange(n) * block  # each block's first and last position
    last = (first + block).clamp(max=length) - 1
    q_first, q_last, k_first, k_last = first[:, None], last[:, None], first[None, :], last[None, :]
    visible = torch.ones(n, n, dtype=torch.bool)  # (query block, key block): some key visible
    full = torch.ones(n, n, dtype=torch.bool)  # every key visible to every query
    if causal:
        visible &= k_first <= q_last
        full &= k_last <= q_first
    if window is not None:
        visible &= q_first - k_last < window
        full &= q_last - k_first < window
    if segments is not None:
        low, high = _block_ranges(segments.cpu(), block, n)  # (B, n) each
        overlap = (low[:, :, None] <= high[:, None, :]) & (low[:, None, :] <= high[:, :, None])  # (B, n, n)
        visible &= overlap.any(dim=0)
        one = (low == high)[:, :, None] & (low == high)[:, None, :] & (low[:, :, None] == low[:, None, :])
        full &= one.all(dim=0)
    pairs = [(i, j, not full[i, j].item()) for i, j in visible.nonzero().tolist()]
    return BlockPlan(block, pairs, n * n)


def _block_ranges(segments: torch.Tensor, block: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's smallest and largest document index, (B, n) each; the last block is padded with its
    own last token, which changes neither."""
    pad = n * block - segments.shape[1]
    padded = torch.cat([segments, segments[:, -1:].expand(-1, pad)], dim=1) if pad else segments
    blocks = padded.reshape(segments.shape[0], n, block)
    return blocks.amin(dim=-1), blocks.amax(dim=-1)


def block_hidden(
    rows: slice, cols: slice, *, causal: bool, window: int | None, segments: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """The keys of one partial block hidden from each query: (Q, T) bool, or (B, 1, 1, Q, T) with
    documents, broadcasting over the (B, K, G, Q, T) scores of :mod:`polyshard.cp.blocks`."""
    query = torch.arange(rows.start, rows.stop, device=device)
    key = torch.arange(cols.start, cols.stop, device=device)
    hidden = torch.zeros(len(query), len(key), dtype=torch.bool, device=device)
    if causal:
        hidden |= key[None, :] > query[:, None]
    if window is not None:
        hidden |= window_hidden(query, key, window)
    if segments is None:
        return hidden
    other = segments[:, rows, None] != segments[:, None, cols]  # (B, Q, 1) != (B, 1, T)
    return (hidden | other)[:, None, None]
