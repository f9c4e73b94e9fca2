"""Multi-head latent attention (MLA; DeepSeek-V2 2405.04434 section 2.1, DeepSeek-V3 2412.19437) as plain
PyTorch.

Keys and values come from one small latent per token: ``kv_down`` maps the hidden state to a
``kv_lora_rank``-wide latent (normed by ``kv_norm``) plus a ``qk_rope_head_dim``-wide rotary key that every
head shares; ``kv_up`` maps the latent to each head's non-rotary key (``qk_nope_head_dim``) and its value
(``v_head_dim``). Queries come straight from the hidden state (``q_proj``, DeepSeek-V2-Lite) or through
a ``q_lora_rank``-wide latent of their own (``q_down``, ``q_norm``, ``q_up``). Each head's query and key
are [non-rotary, rotary]: ``qk_nope_head_dim + qk_rope_head_dim`` dims, while its value has
``v_head_dim``: the attention core takes q/k and v of different head dims. An inference cache would
hold only the latent and the rotary key per token (:func:`kv_cache_width`).

Rotary positions follow DeepSeek's checkpoints: the rotary dims are stored in interleaved pairs
(0, 1), (2, 3), ..., which :func:`deinterleave` puts into :func:`rotate`'s half-split layout, as
transformers' ``apply_rotary_pos_emb_interleave`` does. The softmax scale is 1 / sqrt(q/k head dim),
times YaRN's ``mscale`` squared when the model stretches its context (``softmax_scale``); q is scaled
by softmax_scale x sqrt(D) so every core (SDPA, blocksparse, cp's) runs with its default 1 / sqrt(D).

Tensor parallelism splits the heads: ``q_proj``/``q_up`` and ``kv_up`` by columns, ``o_proj`` by rows;
the down projections and their norms stay whole on every rank, and because each rank's heads use only
part of their outputs, their gradients are summed over tp (the plan marks them as a q/k norm's are).

Shapes: B batch, S sequence, H hidden, N heads (this rank's), R kv_lora_rank, Dn/Dr/Dv the non-rotary,
rotary and value head dims.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from polyshard.models.common.attention import CoreAttention
from polyshard.models.common.documents import Documents
from polyshard.models.common.rotary import RopeConfig, deinterleave, rotate


def kv_cache_width(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Numbers an inference cache keeps per token and layer: the latent and the shared rotary key."""
    return kv_lora_rank + qk_rope_head_dim


class MLA(nn.Module):
    """Multi-head latent attention (see the module's docstring); ``forward(x, documents)`` as
    :class:`~polyshard.models.common.Attention`'s."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope: RopeConfig,
        softmax_scale: float | None = None,
        norm_eps: float = 1e-6,
        bias: bool = False,
        interleaved: bool = True,
        core: str = "auto",
    ):
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank, self.interleaved = kv_lora_rank, interleaved
        self.rope = rope
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        scale = qk_head_dim**-0.5 if softmax_scale is None else softmax_scale
        self.q_factor = scale * math.sqrt(qk_head_dim)  # the core scales by 1 / sqrt(D): q carries the rest
        self.core = CoreAttention(causal=True, core=core)
        self.q_proj: nn.Linear | None = None
        self.q_down: nn.Linear | None = None
        self.q_norm: nn.RMSNorm | None = None
        self.q_up: nn.Linear | None = None
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, num_heads * qk_head_dim, bias=False)
        else:
            self.q_down = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_norm = nn.RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_up = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_down = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_up = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden, bias=bias)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if self.interleaved:
            x = deinterleave(x)
        return rotate(x, self.rope, positions)

    def forward(
        self, x: torch.Tensor, documents: Documents | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``documents``: the batch's documents: attention inside each, rotary positions within each;
        ``positions``: (S,) the tokens' rotary positions when not 0..S-1 (as :class:`Attention`)."""
        positions = positions if documents is None else documents.positions
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_down is not None and self.q_norm is not None and self.q_up is not None  # noqa: S101
            q = self.q_up(self.q_norm(self.q_down(x)))
        q = q.unflatten(-1, (-1, self.qk_nope_head_dim + self.qk_rope_head_dim)).transpose(1, 2)  # (B, N, S, Dn+Dr)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_down(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )  # (B, S, R), (B, S, Dr)
        kv = self.kv_up(self.kv_norm(latent)).unflatten(-1, (-1, self.qk_nope_head_dim + self.v_head_dim))
        k_nope, v = kv.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # (B, N, S, Dn|Dv)
        q_rope = self._rotate(q_rope, positions)
        k_rope = self._rotate(k_rope.unsqueeze(1), positions)  # (B, 1, S, Dr): one rotary key for every head
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.q_factor != 1.0:
            q = q * self.q_factor
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)  # (B, N, S, Dn+Dr)
        extra = {} if documents is None else {"segments": documents.segments}
        pad = self._pad_values(q, v, documents)
        y = self.core(q, k, F.pad(v, (0, pad)) if pad else v.contiguous(), **extra)  # (B, N, S, Dv [+ pad])
        if pad:
            y = y[..., : self.v_head_dim]
        return self.o_proj(y.transpose(1, 2).flatten(2))  # type: ignore[no-any-return]

    def _pad_values(self, q: torch.Tensor, v: torch.Tensor, documents: Documents | None) -> int:
        """Zero dims to append to the values for plain causal SDPA: its fused kernels (FlashAttention on CUDA,
        the CPU's flash kernel) need one head dim for q, k and v, and without them SDPA falls back to
        computing the whole S x S scores (5-9x slower on the CPU at 2K tokens). Zeros weigh nothing in the
        sum and the extra output dims are cut off, so the result is exact. The other cores (blocksparse,
        flex, cp's ring and all-gather) take the values as they are."""
        plain = type(self.core) is CoreAttention and self.core.core in ("auto", "sdpa") and documents is None
        return q.shape[-1] - v.shape[-1] if plain and q.shape[-1] > v.shape[-1] else 0
