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

    clamped-swiglu (gpt-oss): W1 is (E, H, 2F) with the gate's and up's columns interleaved (gate in
    the even columns, up in the odd ones, the layout gpt-oss's fused ``gate_up_proj`` has), so one
    grouped matmul makes both; then g = min(gate, limit), u = clamp(up, -limit, limit) and
    y = ((u + 1) * g * sigmoid(alpha * g)) W2. ``bias``: ``w1_bias`` (E, 2F or F) added after W1 and
    ``w2_bias`` (E, H) after W2, stacked like the weights so ep splits them with their experts.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn_hidden: int,
        activation: str = "swiglu",
        *,
        bias: bool = False,
        alpha: float = 1.702,
        limit: float = 7.0,
    ):
        super().__init__()
        self.activation, self.alpha, self.limit = activation, alpha, limit
        first = 2 * ffn_hidden if activation == "clamped-swiglu" else ffn_hidden
        self.w1 = nn.Parameter(_init(num_experts, hidden, first))
        self.w2 = nn.Parameter(_init(num_experts, ffn_hidden, hidden))
        self.w3 = nn.Parameter(_init(num_experts, hidden, ffn_hidden)) if activation == "swiglu" else None
        self.w1_bias = nn.Parameter(torch.zeros(num_experts, first)) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden)) if bias else None
        self.lora_scale = 0.0
        """LoRA on the experts (:mod:`.lora`): each weight ``w`` with an adapter has ``w_lora_A`` (E, K, r) and
        ``w_lora_B`` (E, r, M) beside it, its update scaled by this; 0 (no adapters) until one is attached."""
        self.lora_dropout: nn.Module = nn.Identity()

    @property
    def num_experts(self) -> int:
        """Experts held by this module (E_local once expert-parallel)."""
        return self.w1.shape[0]

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """(N, H) -> (N, H): rows are grouped by expert, ``counts[e]`` rows for expert e.

        One grouped matmul per weight over all local experts (:func:`grouped_mm`); an expert with no
        rows costs nothing and its gradient is zero.
        """
        h = self._biased(self._project(x, "w1", counts), self.w1_bias, counts)  # (N, H) x (E, H, F) -> (N, F)
        if self.activation == "clamped-swiglu":  # (N, 2F) -> (N, F)
            gate, up = h[:, ::2].clamp(max=self.limit), h[:, 1::2].clamp(-self.limit, self.limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        elif self.w3 is not None:
            h = F.silu(h) * self._project(x, "w3", counts)
        else:
            h = F.gelu(h)
        return self._biased(self._project(h, "w2", counts), self.w2_bias, counts)  # (N, F) x (E, F, H) -> (N, H)

    def _project(self, x: torch.Tensor, weight: str, counts: Sequence[int]) -> torch.Tensor:
        """(N, K) rows times each row's expert's ``weight`` (E, K, M), plus that expert's LoRA update
        scale * (x A_e) B_e when the weight has an adapter: the same grouped matmul, twice, r wide."""
        out = grouped_mm(x, getattr(self, weight), counts)  # (N, K) x (E, K, M) -> (N, M)
        if not self.lora_scale:  # no adapters (a plain float: no module attribute lookup on the common path)
            return out
        a: torch.Tensor = getattr(self, f"{weight}_lora_A")
        b: torch.Tensor = getattr(self, f"{weight}_lora_B")
        x = self.lora_dropout(x).to(a.dtype)  # a base kept in bf16 (model.frozen_dtype): float32 adapters
        update = grouped_mm(grouped_mm(x, a, counts), b, counts)  # (N, K) x (E, K, r) x (E, r, M) -> (N, M)
        return (out + update * self.lora_scale).to(out.dtype)  # the base's dtype, as PEFT returns it

    @staticmethod
    def _biased(y: torch.Tensor, bias: torch.Tensor | None, counts: Sequence[int]) -> torch.Tensor:
        """``y`` (N, M) plus each row's expert's bias (E, M): row r of expert e gets ``bias[e]``."""
        if bias is None:
            return y
        sizes = torch.tensor(list(counts), device=y.device)
        return y + bias.repeat_interleave(sizes, dim=0, output_size=y.shape[0])


GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Rows ``x`` (N, K) grouped by expert (``counts[e]`` rows each, in order) times each expert's
    ``w[e]`` (K, M): ``torch._grouped_mm`` with the groups' end offsets, one kernel for every expert.
    Where it does not apply (no such op in this torch, a dtype it lacks, rows not 16-byte aligned, no
    rows at all), the same product as one batched matmul over rows padded to the largest group."""
    if _grouped_applies(x, w) and x.shape[0]:
        offsets = torch.tensor(list(counts), device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    return _padded_mm(x, w, counts)


def _grouped_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    size = x.element_size()
    aligned = all(d * size % 16 == 0 for d in (x.shape[1], w.shape[1], w.shape[2]))
    return hasattr(torch, "_grouped_mm") and x.dtype in GROUPED_DTYPES and x.dtype == w.dtype and aligned


def _padded_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    experts, longest = len(counts), max(counts, default=0)
    # where each row sits in the (experts x longest) grid: expert e's i-th row at e * longest + i
    where = torch.cat([torch.arange(c, device=x.device) + e * longest for e, c in enumerate(counts)])
    padded = x.new_zeros(experts * longest, x.shape[1]).index_copy(0, where, x)
    out = torch.bmm(padded.view(experts, longest, x.shape[1]), w).view(experts * longest, w.shape[2])
    return out.index_select(0, where)


def _init(num_experts: int, fan_in: int, fan_out: int) -> torch.Tensor:
    # Each expert initialised like an nn.Linear of that shape: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1 / math.sqrt(fan_in)
    return torch.empty(num_experts, fan_in, fan_out).uniform_(-bound, bound)
