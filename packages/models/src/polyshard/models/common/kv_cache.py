"""An inference cache of keys and values for :class:`~polyshard.models.common.Attention`, so generation
computes each token's keys and values once instead of recomputing the whole prefix at every new token.

    with caching(model):                       # one KVCache on every Attention inside ``model`` (caching.py)
        logits = model(prompt)                 # prefill: (B, S0) tokens, causal over themselves
        logits = model(next_token, positions=torch.tensor([S0]))   # decode: one query sees every cached key

Outside :func:`~polyshard.models.common.caching.caching` an attention's ``kv_cache`` is None and its
forward is the training one, bit for bit. Inside, each forward appends its keys and values (after qk-norm
and rotary positions: what every later query reads) and attends over everything cached. Rotary positions
continue from the cache's length by themselves; a learned position table (GPT-2) is the embedding's, so
the caller passes ``positions`` (the cached forward takes them as given, as context parallelism's chunks
are).

Supported: multi-head and grouped-query attention, rotary scaling, qk-norm, biases, sliding windows (the
mask counts positions across the cache) and gpt-oss's sinks (one more logit per head in each softmax).
Refused: multi-head latent attention (DeepSeek-V3's MLA; a cache of its latents is not built), by name
(:class:`~polyshard.models.errors.ConfigError`) in ``caching``, and document masks (a generated row is
one document), by the attention's forward.

Shapes: B batch, N query heads, K key/value heads (this rank's), S new tokens, T cached tokens, D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class KVCache:
    """One attention layer's keys and values so far, (B, K, T, D) each. Stored in buffers that grow by
    doubling, so appending one token copies only that token (a ``torch.cat`` per step would copy all T)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def positions(self, new: int, device: torch.device) -> torch.Tensor:
        """(S,) the rotary positions of ``new`` tokens appended now: they continue from the cache."""
        return torch.arange(self.length, self.length + new, device=device)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add (B, K, S, D) keys and values; returns every cached one, (B, K, T + S, D) views."""
        end = self.length + k.shape[2]
        if self.keys is None or self.values is None or end > self.keys.shape[2]:
            self._grow(k, v, end)
        assert self.keys is not None and self.values is not None  # noqa: S101  (_grow set them)
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, k: torch.Tensor, v: torch.Tensor, needed: int) -> None:
        capacity = max(needed, 2 * (0 if self.keys is None else self.keys.shape[2]))
        keys = k.new_empty(*k.shape[:2], capacity, k.shape[3])
        values = v.new_empty(*v.shape[:2], capacity, v.shape[3])
        if self.keys is not None and self.values is not None:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def repeat_rows(self, times: int) -> None:
        """Each row's cache ``times`` times over, consecutively (row r becomes rows r*times .. r*times +
        times - 1): one prompt prefilled once serves several samples."""
        if self.keys is not None and self.values is not None:
            self.keys = self.keys[:, :, : self.length].repeat_interleave(times, dim=0)
            self.values = self.values[:, :, : self.length].repeat_interleave(times, dim=0)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append (B, K, S, D) ``k`` and ``v``, then attend (B, N, S, D) ``q`` (the last S positions) over
        every cached key: causal among the new tokens, each sees all earlier ones (the last ``window``
        with a sliding window). -> (B, N, S, D)."""
        offset = self.length  # the new queries' first position
        keys, values = self.append(k, v)
        s, t = q.shape[2], keys.shape[2]
        gqa = q.shape[1] != keys.shape[1]
        if window is None and sinks is None and (offset == 0 or s == 1):
            # A prefill is plain causal attention, a one-token step sees every key: no mask to build.
            return F.scaled_dot_product_attention(q, keys, values, is_causal=offset == 0 and s > 1, enable_gqa=gqa)
        query = torch.arange(offset, offset + s, device=q.device)[:, None]  # (S, 1) positions
        key = torch.arange(t, device=q.device)[None, :]  # (1, T)
        visible = key <= query
        if window is not None:
            visible = visible & (query - key < window)
        if sinks is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=gqa)
        return _attend_with_sinks(q, keys, values, visible, sinks)


def _attend_with_sinks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """softmax([q k^T / sqrt(D) masked, sink]) v in float32, the sink's column dropped after the softmax
    (gpt-oss; as the dense reference core computes it, with the queries offset into the cache)."""
    b, n, s, d = q.shape
    repeat = n // keys.shape[1]  # grouped-query attention: query head h reads key/value head h // repeat
    keys, values = (x.float().repeat_interleave(repeat, dim=1) for x in (keys, values))
    scores = (q.float() @ keys.transpose(-1, -2)) / math.sqrt(d)  # (B, N, S, T)
    scores = scores.masked_fill(~visible, float("-inf"))
    scores = torch.cat([scores, sinks.float().reshape(1, n, 1, 1).expand(b, n, s, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :-1]
    return (probs @ values).to(q.dtype)  # (B, N, S, T) @ (B, N, T, D)
