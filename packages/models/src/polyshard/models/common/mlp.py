"""The MLPs: GPT-2's GELU MLP and Llama's SwiGLU, and the norms (LayerNorm or RMSNorm) around them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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


def norm_layer(kind: str, hidden: int, eps: float = 1e-5) -> nn.Module:
    """LayerNorm (GPT-2) or RMSNorm (Llama) over the hidden dim."""
    if kind not in NORMS:
        raise ValueError(f"norm {kind!r}: choose one of {NORMS}")
    return nn.LayerNorm(hidden, eps=eps) if kind == "layer" else nn.RMSNorm(hidden, eps=eps)
