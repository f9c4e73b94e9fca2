"""Plain PyTorch models for the tp tests: no parallelism inside, as a user would write them.

Shapes: B batch, S sequence, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.mesh import get_placement
from polyshard.tp import (
    ColumnParallel,
    RowParallel,
    SequenceParallel,
    ShardHeads,
    SplitSequence,
    TPEntry,
    VocabParallel,
    gather_full_tensor,
)


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections and grouped-query kv heads."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, hidden // num_heads
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim)
        self.k_proj = nn.Linear(hidden, num_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(hidden, num_kv_heads * self.head_dim)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        group = self.num_heads // self.num_kv_heads  # query heads per kv head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, S, head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, num_heads, num_kv_heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, num_heads: int, num_layers: int, max_seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, num_heads, num_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)  # (B, S, H)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, S, V); under tp (B, S, Vp/tp)


def block_plan(prefix: str, sequence_parallel: bool) -> dict:
    sp = {"sequence_parallel": sequence_parallel}
    plan = {
        f"{prefix}attn": [TPEntry(**sp), ShardHeads()],
        f"{prefix}attn.[qkv]_proj": ColumnParallel(input_entered=True),
        f"{prefix}attn.o_proj": RowParallel(**sp),
        f"{prefix}mlp.fc1": ColumnParallel(**sp),
        f"{prefix}mlp.fc2": RowParallel(**sp),
    }
    if sequence_parallel:
        plan[f"{prefix}ln_*"] = SequenceParallel()
    return plan


def gpt_plan(sequence_parallel: bool) -> dict:
    plan = {"tok": VocabParallel(), **block_plan("blocks.*.", sequence_parallel)}
    plan["head"] = VocabParallel(sequence_parallel=sequence_parallel)
    if sequence_parallel:
        # token + position embeddings are replicated; the first block splits them along the sequence.
        plan["blocks.0"] = SplitSequence()
        plan["ln_f"] = SequenceParallel()
    return plan


def full_grads(model: nn.Module, tp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, unsharded, under its (original) name."""
    return {n: gather_full_tensor(p.grad, get_placement(p), tp_group) for n, p in model.named_parameters()}


def assert_dicts_close(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}", **tol)
