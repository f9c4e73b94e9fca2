"""Experts stored as stacked weights: one tensor of shape (E_local, ...) per weight.

Shapes: N tokens routed here, H hidden, F expert ffn width, E_local experts on this rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    """``num_experts`` independent MLPs whose weights are stacked on dim 0.

    swiglu: y = (silu(x W1) * (x W3)) W2      gelu: y = gelu(x W1) W2
    with W1, W3: (E, H, F) and W2: (E, F, H). Stacking on the expert dim is what
    lets expert parallelism shard them with one slice (``Shard(0)`` over ep).
    """

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, activation: str = "swiglu"):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Parameter(_init(num_experts, hidden, ffn_hidden))
        self.w2 = nn.Parameter(_init(num_experts, ffn_hidden, hidden))
        self.w3 = nn.Parameter(_init(num_experts, hidden, ffn_hidden)) if activation == "swiglu" else None

    @property
    def num_experts(self) -> int:
        """Experts held by this module (E_local once expert-parallel)."""
        return self.w1.shape[0]

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """(N, H) -> (N, H): rows are grouped by expert, ``counts[e]`` rows for expert e.

        A plain loop over experts: each one is a dense matmul on its own rows,
        and an expert with no rows costs nothing (its gradient is zero).
        """
        outputs = [self._expert(e, rows) for e, rows in enumerate(x.split(list(counts)))]
        return torch.cat(outputs) if outputs else x[:0]

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w1[e]  # (n, H) @ (H, F) -> (n, F)
        h = F.silu(h) * (x @ self.w3[e]) if self.w3 is not None else F.gelu(h)
        return h @ self.w2[e]  # (n, F) @ (F, H) -> (n, H)


def _init(num_experts: int, fan_in: int, fan_out: int) -> torch.Tensor:
    # Each expert initialised like an nn.Linear of that shape: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1 / math.sqrt(fan_in)
    return torch.empty(num_experts, fan_in, fan_out).uniform_(-bound, bound)
