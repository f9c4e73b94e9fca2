"""Plain PyTorch modules of the kind tensor parallelism converts: an MLP, causal self-attention with
grouped-query kv heads, and a pre-norm block. No parallelism inside, as a user would write them;
the benchmark and the tests convert them with :func:`polyshard.tp.parallelize`.

Shapes: B batch, S sequence, H hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# nn.Module.__call__ returns Any in torch's stubs, hence the ignores on the forwards' returns.


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # type: ignore[no-any-return]


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections; ``num_kv_heads`` (default: all) kv heads."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int | None = None):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, hidden // num_heads
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim)
        self.k_proj = nn.Linear(hidden, num_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(hidden, num_kv_heads * self.head_dim)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Head counts are read at run time, so a tp rank holding num_heads/tp of them runs unchanged.
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        group = self.num_heads // self.num_kv_heads  # query heads per kv head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, S, head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))  # type: ignore[no-any-return]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, num_heads, num_kv_heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]
