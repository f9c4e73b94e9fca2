"""Self-attention as plain PyTorch: the q/k/v/o projections (:class:`Attention`) around a parameter-free
core (:class:`CoreAttention`), the one piece a parallelism that splits the sequence replaces.

Shapes: B batch, S sequence, H hidden, D head dim, N query heads, K key/value heads. Attention reshapes
with ``-1`` heads, so a tensor-parallel rank whose q/k/v projections hold N/tp and K/tp heads runs the
same code unchanged. ``nn.Module.__call__`` returns Any in torch's stubs, hence the ignores on the
forwards' returns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from polyshard.models.common.cores import CORES, block_sparse_attention, choose_core, flex_core
from polyshard.models.common.documents import Documents
from polyshard.models.common.kv_cache import KVCache
from polyshard.models.common.rotary import RopeConfig, rotate


class CoreAttention(nn.Module):
    """Attention's inner product: softmax(q k^T / sqrt(D)) v over (B, N, S, D) heads, causal or not, with
    grouped-query attention when k and v hold fewer heads. ``window``: each query sees only the last
    ``window`` tokens, itself included (a sliding-window layer). ``core``: which implementation runs
    (:mod:`polyshard.models.common.cores`; ``auto`` keeps plain causal SDPA whenever nothing else is
    masked). No parameters (sinks are the attention's and come with each call): a parallelism that
    splits the sequence or the heads (context parallelism) wraps or swaps this module and nothing else."""

    def __init__(self, *, causal: bool = True, dropout: float = 0.0, window: int | None = None, core: str = "auto"):
        super().__init__()
        if core not in CORES:
            raise ValueError(f"attention core {core!r} is unknown; choose one of {CORES}")
        if window is not None and (not causal or window < 1):
            raise ValueError(f"sliding window {window} needs causal attention and at least 1 token (the query)")
        self.causal, self.dropout, self.window, self.core = causal, dropout, window, core

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``segments`` (B, S): each token's document; attention then stays inside each. ``sinks`` (N,):
        one logit per query head in every softmax denominator, which adds no value (gpt-oss)."""
        masked = segments is not None or self.window is not None or sinks is not None
        core = choose_core(self.core, masked, q.device)
        dropout = self.dropout if self.training else 0.0
        if core == "sdpa":
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=self.causal, dropout_p=dropout, enable_gqa=q.shape[1] != k.shape[1]
            )
        if dropout:
            raise ValueError(
                f"attention dropout {self.dropout} runs only on the plain SDPA core, not under document masks, "
                "sliding windows or sinks; set the model's dropout to 0"
            )
        kernel = flex_core if core == "flex" else block_sparse_attention
        return kernel(q, k, v, causal=self.causal, window=self.window, segments=segments, sinks=sinks)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, window={self.window}, core={self.core!r}"


class Attention(nn.Module):
    """Self-attention with separate q/k/v projections; ``num_kv_heads`` (default: all) key/value heads;
    rotary positions on q and k when ``rope`` is given (Llama; its scaling for Llama 3.1's long context);
    ``bias`` on the projections (GPT-2), or ``qkv_bias`` on q, k and v only (Qwen2).
    ``head_dim`` (default hidden / num_heads) may differ from that (Qwen3: 128 whatever the width).
    ``qk_norm``: an RMSNorm over each head's q and k, before rotary positions (Qwen3, OLMo 2's per-head
    form); its weight has one entry per head dim, shared by every head, so tp replicates it.
    ``window``: a sliding-window layer (each query sees the last ``window`` tokens, itself included).
    ``sinks``: a learned logit per query head in every softmax denominator (gpt-oss), the parameter
    ``sinks`` (N,), split with the heads under tp. ``core``: :class:`CoreAttention`'s choice.
    ``kv_cache``: None in training; generation sets a :class:`~polyshard.models.common.kv_cache.KVCache`
    (:func:`~polyshard.models.common.caching.caching`), and the forward then appends to it and attends
    over it instead of running the core."""

    kv_cache: KVCache | None = None

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        causal: bool = True,
        dropout: float = 0.0,
        bias: bool = True,
        rope: RopeConfig | None = None,
        head_dim: int | None = None,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        window: int | None = None,
        sinks: bool = False,
        core: str = "auto",
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden // num_heads
        self.rope = rope
        self.core = CoreAttention(causal=causal, dropout=dropout, window=window, core=core)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None  # (N,): one logit per query head

    def forward(
        self, x: torch.Tensor, documents: Documents | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``documents``: the batch's documents (see :class:`Documents`): attention inside each, rotary
        positions within each. ``positions``: (S,) the tokens' rotary positions when they are not 0..S-1
        (context parallelism's chunks); the documents' own positions take their place."""
        # (B, S, H) -> (B, N, S, D); N is whatever this rank holds. unflatten infers N from the last
        # dim alone, so an empty batch (B = 0) works too.
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))  # (B, S, N, D)
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))  # (B, S, K, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over each head's D dims
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        cache = self.kv_cache
        if cache is not None:
            if documents is not None:
                raise ValueError("a KV cache holds one sequence per row: generate without document masks")
            if positions is None:
                positions = cache.positions(q.shape[2], q.device)
        if self.rope is not None:
            positions = positions if documents is None else documents.positions
            q = rotate(q, self.rope, positions)
            k = rotate(k, self.rope, positions)
        if cache is not None:
            y = cache.attend(q, k, v, window=getattr(self.core, "window", None), sinks=self.sinks)
            return self.o_proj(y.transpose(1, 2).flatten(2))  # type: ignore[no-any-return]
        # Only what is set is passed, so a core that knows no documents or sinks (a user's) still fits.
        extra = {} if documents is None else {"segments": documents.segments}
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        y = self.core(q, k, v, **extra)
        return self.o_proj(y.transpose(1, 2).flatten(2))  # type: ignore[no-any-return]
