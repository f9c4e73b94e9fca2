"""Attention heads under tensor parallelism.

Query, key and value projections are column parallel and the output
projection row parallel, so each rank runs whole heads: with 8 query heads
and 2 key/value heads (grouped-query attention) on tp=2, rank 0 holds query
heads 0-3 and kv head 0, rank 1 query heads 4-7 and kv head 1 -- query head
i still reads kv head i // 4, because both are split into contiguous ranges.
tp must therefore divide the number of query heads, and either divide the
kv heads or be a multiple of them.

When tp exceeds the kv heads (Llama-3-8B's 8 kv heads on tp=16), each kv head
is *replicated* on tp / kv ranks, as Megatron-LM does: with 4 query heads and
2 kv heads on tp=4, ranks 0 and 1 compute kv head 0, ranks 2 and 3 kv head 1
(:class:`ReplicatedKVLinear`). Each rank keeps the whole k/v weight and
computes only its head's rows; since each of the replicas sees the gradient of
its own query heads only, the weight's gradient is summed over tp on the way
back (``copy_to``: identity forward, all-reduce backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.collectives import copy_to
from polyshard.mesh import divisors
from polyshard.tp.errors import TPShapeError
from polyshard.tp.shard import choices, record_replicate, tp_rank, tp_size


def valid_tp_sizes(num_heads: int, num_kv_heads: int | None = None, *, replicate_kv: bool = False) -> list[int]:
    """The tp sizes that split both head counts evenly, e.g. (8, 2) -> [1, 2]; with ``replicate_kv``
    also those that replicate the kv heads, (8, 2) -> [1, 2, 4, 8]."""
    kv = num_kv_heads or num_heads
    return [t for t in divisors(num_heads) if kv % t == 0 or (replicate_kv and t % kv == 0)]


def replicates_kv(num_kv_heads: int, tp: int) -> bool:
    """Whether tp replicates each kv head (tp is a multiple of the kv heads, and larger)."""
    return tp > num_kv_heads and tp % num_kv_heads == 0


def heads_per_rank(
    num_heads: int, num_kv_heads: int | None, tp: int, where: str = "", *, replicate_kv: bool = False
) -> tuple[int, int]:
    """(query heads, kv heads) on each rank (1 kv head when ``replicate_kv`` and tp is a multiple of
    the kv heads); a :class:`TPShapeError` listing valid tp sizes otherwise."""
    num_kv_heads = num_kv_heads or num_heads
    where = f" of {where}" if where else ""
    kv_fits = num_kv_heads % tp == 0 or (replicate_kv and tp % num_kv_heads == 0)
    fits = {"num_heads": num_heads % tp == 0, "num_kv_heads": kv_fits}
    for what, ok in fits.items():
        if not ok:
            count = num_heads if what == "num_heads" else num_kv_heads
            how = "divide or be a multiple of" if what == "num_kv_heads" and replicate_kv else "divide"
            valid = valid_tp_sizes(num_heads, num_kv_heads, replicate_kv=replicate_kv)
            raise TPShapeError(f"tp={tp} does not {how} {what}={count}{where}; choose tp in {choices(valid)}")
    return num_heads // tp, max(1, num_kv_heads // tp)


class ReplicatedKVLinear(nn.Module):
    """A k or v projection of ``num_kv_heads`` heads on a tp group larger than that: the whole weight
    (replicated), of which this rank computes the rows of kv head ``rank // (tp / num_kv_heads)``:
    (B, S, I) -> (B, S, D). Its gradient is summed over tp (see the module docstring)."""

    def __init__(self, source: nn.Linear, num_kv_heads: int, *, tp_group: dist.ProcessGroup | None, axis: str):
        super().__init__()
        tp = tp_size(tp_group)
        self.tp_group, self.num_kv_heads = tp_group, num_kv_heads
        self.in_features, self.out_features = source.in_features, source.out_features
        head_dim = source.out_features // num_kv_heads
        head = tp_rank(tp_group) // (tp // num_kv_heads)
        self.rows = slice(head * head_dim, (head + 1) * head_dim)
        self.weight = source.weight
        self.bias = source.bias
        for name, param in (("weight", self.weight), ("bias", self.bias)):
            if param is not None:
                record_replicate(param, name, axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to(self.weight, self.tp_group)[self.rows]
        bias = copy_to(self.bias, self.tp_group)[self.rows] if self.bias is not None else None
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (this rank: rows {self.rows})"
