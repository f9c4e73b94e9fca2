"""The transformer block as plain PyTorch: pre-norm attention + MLP, no parallelism inside.

These are the modules tensor parallelism converts (:func:`polyshard.tp.parallelize` with a plan
that names ``attn.[qkv]_proj``, ``attn.o_proj``, ``mlp.fc_in``, ``mlp.fc_out``), the ones tp's
benchmark and tests use, and the ones the trainer's GPT and ViT are built from: one block, one
place.

Shapes: B batch, S sequence, H hidden, D head dim, N query heads, K key/value heads.

Attention reshapes with ``-1`` heads, so a tensor-parallel rank whose q/k/v projections hold N/tp
and K/tp heads runs the same code unchanged. ``nn.Module.__call__`` returns Any in torch's stubs,
hence the ignores on the forwards' returns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Attention(nn.Module):
    """Self-attention with separate q/k/v projections; ``num_kv_heads`` (default: all) key/value heads."""

    def __init__(
        self, hidden: int, num_heads: int, num_kv_heads: int | None = None, *, causal: bool = True, dropout: float = 0.0
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden // num_heads
        self.causal, self.dropout = causal, dropout
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim)
        self.k_proj = nn.Linear(hidden, num_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(hidden, num_kv_heads * self.head_dim)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, S, H) -> (B, N, S, D); N is whatever this rank holds. unflatten infers N from the last
        # dim alone, so an empty batch (B = 0) works too.
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=self.causal,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return self.o_proj(y.transpose(1, 2).flatten(2))  # type: ignore[no-any-return]


class MLP(nn.Module):
    """fc_out(gelu(fc_in(x))) with GPT-2's tanh GELU; ``mlp_hidden`` defaults to 4 x hidden."""

    def __init__(self, hidden: int, mlp_hidden: int | None = None):
        super().__init__()
        mlp_hidden = mlp_hidden or 4 * hidden
        self.fc_in = nn.Linear(hidden, mlp_hidden)
        self.fc_out = nn.Linear(mlp_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))  # type: ignore[no-any-return]


class Block(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); ``mlp`` may be replaced (e.g. by an MoE layer).

    With ``checkpoint_activations`` only the block's input is kept for backward;
    everything inside is recomputed then (Chen et al. 1604.06174), trading a
    second forward for the memory of every intermediate activation.
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
        checkpoint_activations: bool = False,
    ):
        super().__init__()
        self.checkpoint_activations = checkpoint_activations
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, num_heads, num_kv_heads, causal=causal, dropout=dropout)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, mlp_ratio * hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)  # type: ignore[no-any-return]
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))  # type: ignore[no-any-return]
