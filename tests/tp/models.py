"""Plain PyTorch models for the tp tests: no parallelism inside, as a user would write them.

Shapes: B batch, S sequence, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from polyshard.mesh import get_placement
from polyshard.models.common import MLP, Attention, Block  # noqa: F401  (the tests import them from here)
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
        f"{prefix}mlp.fc_in": ColumnParallel(**sp),
        f"{prefix}mlp.fc_out": RowParallel(**sp),
    }
    if sequence_parallel:
        plan[f"{prefix}norm*"] = SequenceParallel()
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
