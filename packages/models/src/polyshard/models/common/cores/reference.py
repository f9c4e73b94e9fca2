"""The dense reference every core is tested against: one (B, 1, S, S) boolean mask and one softmax over
all keys (and the sinks), in float32, differentiated by autograd. Its memory grows with S^2: tests and
benchmarks only, never a training path.

Shapes: B batch, N query heads, K key/value heads, S sequence, D query/key head dim, E value head dim.
"""

from __future__ import annotations

import math

import torch

from polyshard.models.common.documents import document_mask


def visible_mask(
    length: int, *, causal: bool, window: int | None = None, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """(B or 1, 1, S, S) bool, True where a query (row) may see a key (column)."""
    position = torch.arange(length, device=None if segments is None else segments.device)
    if segments is not None:
        visible = document_mask(segments, segments, causal)  # (B, 1, S, S)
    else:
        visible = torch.ones(1, 1, length, length, dtype=torch.bool)
        if causal:
            visible = visible.tril()
    if window is not None:
        visible = visible & (position[:, None] - position[None, :] < window)
    return visible


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    segments: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax([q k^T * scale masked, sinks]) v over (B, N, S, D) queries, (B, K, S, D) keys and
    (B, K, S, E) values, the sink column dropped after the softmax: (B, N, S, E) in q's dtype."""
    b, n, s, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    repeat = n // k.shape[1]  # grouped-query attention: query head h reads key/value head h // repeat
    keys, values = (t.float().repeat_interleave(repeat, dim=1) for t in (k, v))
    scores = (q.float() @ keys.transpose(-1, -2)) * scale  # (B, N, S, D) @ (B, N, D, S) -> (B, N, S, S)
    scores = scores.masked_fill(~visible_mask(s, causal=causal, window=window, segments=segments), float("-inf"))
    if sinks is not None:  # one more logit per head in every row's denominator
        scores = torch.cat([scores, sinks.float().reshape(1, n, 1, 1).expand(b, n, s, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :s]
    return (probs @ values).to(q.dtype)  # (B, N, S, S) @ (B, N, S, E)
