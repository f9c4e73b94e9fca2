"""The documents of a packed batch (document masking): which document each token belongs to, and its
position within it. Passed to the attention layers with each forward; left None, nothing changes.

Shapes: B batch, S sequence, Q queries, T keys.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Documents(NamedTuple):
    """The documents of a packed batch: ``segments`` (B, S) int64, each token's document index within its
    row (0, 1, 2, ...; non-decreasing, a new document starts where it increases), and ``positions`` (B, S),
    each token's position within its document (:func:`document_positions` of the whole row; under context
    parallelism both are this rank's chunks of them)."""

    segments: torch.Tensor
    positions: torch.Tensor


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document, from (B, S) document indices: 0 where a row starts or its
    index increases, counting up until the next start. ``[[0, 0, 0, 1, 1, 2]] -> [[0, 1, 2, 0, 1, 0]]``."""
    index = torch.arange(segments.shape[-1], device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[..., 1:] = segments[..., 1:] != segments[..., :-1]
    first = torch.where(starts, index, 0).cummax(dim=-1).values  # where each token's document starts
    return index - first


def document_mask(query_segments: torch.Tensor, key_segments: torch.Tensor, causal: bool) -> torch.Tensor:
    """Which keys each query may see, (B, 1, Q, T) bool for SDPA's ``attn_mask`` (True: attend): the same
    document, and with ``causal`` not a later token (queries and keys at the same positions)."""
    visible = query_segments.unsqueeze(-1) == key_segments.unsqueeze(-2)  # (B, Q, 1) == (B, 1, T)
    if causal:
        visible &= torch.ones(visible.shape[-2:], dtype=torch.bool, device=visible.device).tril()
    return visible.unsqueeze(1)
