"""The transformer block as plain PyTorch: pre-norm attention + MLP, no parallelism inside.

These are the modules tensor parallelism converts (:func:`polyshard.tp.parallelize` with a plan
that names ``attn.[qkv]_proj``, ``attn.o_proj``, ``mlp.fc_in``, ``mlp.fc_out``), the ones tp's
benchmark and tests use, and the ones the trainer's GPT and ViT are built from: one block, one
place.

Shapes: B batch, S sequence, H hidden, D head dim, N query heads, K key/value heads.

Document masking (packed rows of several documents): :class:`Documents` holds each token's document
index within its row (``segments``, non-decreasing along the row) and its position within its document;
set on a :class:`Block` as ``block.documents`` around its forward, it keeps attention inside each
document (a block-diagonal causal mask) and restarts rotary positions at each document. Left None (the
default) nothing changes: the plain causal SDPA call runs, bit for bit as without it.

Attention reshapes with ``-1`` heads, so a tensor-parallel rank whose q/k/v projections hold N/tp
and K/tp heads runs the same code unchanged. ``nn.Module.__call__`` returns Any in torch's stubs,
hence the ignores on the forwards' returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from polyshard.tp.recompute import checkpoint_mode, selective_contexts


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (Hugging Face's ``rope_type = "llama3"``), which stretches
    a model trained on ``original_context`` positions to ``factor`` times as many: a frequency whose
    wavelength exceeds ``original_context / low_freq_factor`` is divided by ``factor``, one whose
    wavelength is below ``original_context / high_freq_factor`` is kept, and those between move
    smoothly from one to the other. Llama 3.2: factor 32, low 1, high 4, original 8192."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"rope scaling factor={self.factor} must be a finite number >= 1 (1: no scaling)")
        if not (0.0 < self.low_freq_factor < self.high_freq_factor and math.isfinite(self.high_freq_factor)):
            raise ValueError(
                f"rope scaling needs 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor "
                f"({self.high_freq_factor}); Llama 3 uses 1 and 4"
            )
        if self.original_context < 1:
            raise ValueError(f"rope scaling original_context={self.original_context} must be >= 1 (Llama 3: 8192)")


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The D/2 rotation frequencies theta^(-2i/D) in float32, computed as transformers computes them
    (1 / theta^(2i/D), bit for bit); with ``scaling`` rescaled by exactly the rule (and the order of
    operations) of its ``_compute_llama3_parameters``."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(torch.float32) / head_dim
    inv = 1.0 / (theta**exponents)
    if scaling is None:
        return inv
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv
    long_wavelength, short_wavelength = scaling.original_context / low, scaling.original_context / high
    scaled = torch.where(wavelength > long_wavelength, inv / factor, inv)  # low frequencies: slowed down
    smooth = (scaling.original_context / wavelength - low) / (high - low)  # 0 at long, 1 at short
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(between, smoothed, scaled)


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


def rotate(
    x: torch.Tensor, theta: float, scaling: RopeScaling | None = None, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2104.09864) of ``x`` (B, N, S, D), in the half-split
    layout Llama and Hugging Face use: dims i and i + D/2 form a pair rotated by pos x theta^(-2i/D)
    (frequencies rescaled by ``scaling`` for Llama 3.1's long context).
    ``positions`` (S,) are the tokens' positions in their sequence: 0..S-1 by default; context
    parallelism, where a rank holds two chunks of the sequence, passes theirs; document masking passes
    (B, S), each row's positions within its documents."""
    d, s = x.shape[-1], x.shape[-2]
    inv = rope_frequencies(d, theta, scaling, x.device)
    pos = torch.arange(s, device=x.device) if positions is None else positions.to(x.device)
    if pos.dim() == 1:
        angles = torch.outer(pos.to(torch.float32), inv)  # (S, D/2)
    else:  # per row: (B, S, 1) * (D/2,) -> (B, 1, S, D/2), broadcast over the heads
        angles = (pos.to(torch.float32).unsqueeze(-1) * inv).unsqueeze(1)
    twice = (1,) * (angles.dim() - 1) + (2,)  # the D/2 angles for dims i and i + D/2
    cos, sin = angles.cos().repeat(twice), angles.sin().repeat(twice)  # (S, D) or (B, 1, S, D)
    x32 = x.float()
    half = torch.cat([-x32[..., d // 2 :], x32[..., : d // 2]], dim=-1)
    return (x32 * cos + half * sin).to(x.dtype)


class CoreAttention(nn.Module):
    """Attention's inner product: softmax(q k^T / sqrt(D)) v over (B, N, S, D) heads, causal or not, with
    grouped-query attention when k and v hold fewer heads. No parameters: a parallelism that splits the
    sequence (context parallelism's ring attention) swaps this module and nothing else."""

    def __init__(self, *, causal: bool = True, dropout: float = 0.0):
        super().__init__()
        self.causal, self.dropout = causal, dropout

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``segments`` (B, S): each token's document; attention then stays inside each document."""
        if segments is None:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=self.causal,
                dropout_p=self.dropout if self.training else 0.0,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        # An explicit boolean mask: every query sees at least itself, so no row is fully masked. (On one
        # document per row it equals is_causal=True bit for bit on CPU, tests/trainer/test_documents.py.)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=document_mask(segments, segments, self.causal),
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1],
        )


class Attention(nn.Module):
    """Self-attention with separate q/k/v projections; ``num_kv_heads`` (default: all) key/value heads;
    rotary positions on q and k when ``rope_theta`` is given (Llama; ``rope_scaling`` for Llama 3.1's
    long context); ``bias`` on the projections (GPT-2), or ``qkv_bias`` on q, k and v only (Qwen2).
    ``head_dim`` (default hidden / num_heads) may differ from that (Qwen3: 128 whatever the width).
    ``qk_norm``: an RMSNorm over each head's q and k, before rotary positions (Qwen3, OLMo 2's per-head
    form); its weight has one entry per head dim, shared by every head, so tp replicates it."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        causal: bool = True,
        dropout: float = 0.0,
        bias: bool = True,
        rope_theta: float | None = None,
        rope_scaling: RopeScaling | None = None,
        head_dim: int | None = None,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden // num_heads
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.core = CoreAttention(causal=causal, dropout=dropout)
        self.positions: torch.Tensor | None = None  # rotary positions of the tokens; None: 0..S-1
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """``documents``: the batch's documents (see :class:`Documents`): attention inside each, rotary
        positions within each."""
        # (B, S, H) -> (B, N, S, D); N is whatever this rank holds. unflatten infers N from the last
        # dim alone, so an empty batch (B = 0) works too.
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))  # (B, S, N, D)
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))  # (B, S, K, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over each head's D dims
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        if self.rope_theta is not None:
            positions = self.positions if documents is None else documents.positions
            q = rotate(q, self.rope_theta, self.rope_scaling, positions)
            k = rotate(k, self.rope_theta, self.rope_scaling, positions)
        y = self.core(q, k, v) if documents is None else self.core(q, k, v, documents.segments)
        return self.o_proj(y.transpose(1, 2).flatten(2))  # type: ignore[no-any-return]


class MLP(nn.Module):
    """fc_out(gelu(fc_in(x))) with GPT-2's tanh GELU; ``mlp_hidden`` defaults to 4 x hidden."""

    def __init__(self, hidden: int, mlp_hidden: int | None = None, *, bias: bool = True):
        super().__init__()
        mlp_hidden = mlp_hidden or 4 * hidden
        self.fc_in = nn.Linear(hidden, mlp_hidden, bias=bias)
        self.fc_out = nn.Linear(mlp_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))  # type: ignore[no-any-return]


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) (Shazeer 2002.05202), Llama's MLP, without biases.
    Under tp, gate and up split by columns and down by rows: each rank's share is a whole SwiGLU."""

    def __init__(self, hidden: int, mlp_hidden: int, *, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, mlp_hidden, bias=bias)
        self.up_proj = nn.Linear(hidden, mlp_hidden, bias=bias)
        self.down_proj = nn.Linear(mlp_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


NORMS = ("layer", "rms")
ACTIVATIONS = ("gelu", "swiglu")


def norm_layer(kind: str, hidden: int, eps: float = 1e-5) -> nn.Module:
    """LayerNorm (GPT-2) or RMSNorm (Llama) over the hidden dim."""
    if kind not in NORMS:
        raise ValueError(f"norm {kind!r}: choose one of {NORMS}")
    return nn.LayerNorm(hidden, eps=eps) if kind == "layer" else nn.RMSNorm(hidden, eps=eps)


class Block(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); ``mlp`` may be replaced (e.g. by an MoE layer).

    GPT-2 by default; Llama with ``norm="rms"``, ``activation="swiglu"``, ``bias=False`` and a
    ``rope_theta`` (and ``rope_scaling`` for Llama 3.1+); ``norm_eps`` is every norm's epsilon (q/k norm's
    too); ``head_dim``, ``qkv_bias`` and ``qk_norm`` are :class:`Attention`'s (Qwen2, Qwen3).
    With ``checkpoint_activations`` ``"full"`` (or True) only the block's input is kept for backward;
    everything inside is recomputed then (Chen et al. 1604.06174), trading a
    second forward for the memory of every intermediate activation. ``"selective"`` also keeps the
    matmul and attention outputs and recomputes only the elementwise work (:mod:`polyshard.tp.recompute`).

    ``documents`` (None: one sequence per row) is the :class:`Documents` of the batch being run, set by the
    caller around the forward (a pipeline sets each microbatch's); the forward reads it once, so a
    recompute in backward sees the same documents whatever the attribute holds by then.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        mlp_ratio: int = 4,
        *,
        causal: bool = True,
        dropout: float = 0.0,
        checkpoint_activations: bool | str = False,
        norm: str = "layer",
        activation: str = "gelu",
        bias: bool = True,
        rope_theta: float | None = None,
        rope_scaling: RopeScaling | None = None,
        mlp_hidden: int | None = None,
        norm_eps: float = 1e-5,
        head_dim: int | None = None,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: choose one of {ACTIVATIONS}")
        self.checkpoint_activations = checkpoint_mode(checkpoint_activations)  # None, "full" or "selective"
        self.norm1 = norm_layer(norm, hidden, norm_eps)
        self.attn = Attention(
            hidden,
            num_heads,
            num_kv_heads,
            causal=causal,
            dropout=dropout,
            bias=bias,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            head_dim=head_dim,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            norm_eps=norm_eps,
        )
        self.norm2 = norm_layer(norm, hidden, norm_eps)
        width = mlp_hidden or mlp_ratio * hidden
        self.mlp: nn.Module = (
            MLP(hidden, width, bias=bias) if activation == "gelu" else SwiGLU(hidden, width, bias=bias)
        )
        self.drop = nn.Dropout(dropout)
        self.documents: Documents | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        documents = self.documents
        mode = self.checkpoint_activations
        if mode is not None and torch.is_grad_enabled():
            if mode == "selective":
                return checkpoint(  # type: ignore[no-any-return]
                    self._forward, x, documents, use_reentrant=False, context_fn=selective_contexts
                )
            # No context_fn for "full" (the default no-op): torch.compile traces checkpoint only without one.
            return checkpoint(self._forward, x, documents, use_reentrant=False)  # type: ignore[no-any-return]
        return self._forward(x, documents)

    def _forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        attended = self.attn(self.norm1(x)) if documents is None else self.attn(self.norm1(x), documents)
        x = x + self.drop(attended)
        return x + self.drop(self.mlp(self.norm2(x)))  # type: ignore[no-any-return]
