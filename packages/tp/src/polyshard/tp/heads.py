"""Attention heads under tensor parallelism.

Query, key and value projections are column parallel and the output
projection row parallel, so each rank runs whole heads: with 8 query heads
and 2 key/value heads (grouped-query attention) on tp=2, rank 0 holds query
heads 0-3 and kv head 0, rank 1 query heads 4-7 and kv head 1 -- query head
i still reads kv head i // 4, because both are split into contiguous ranges.
tp must therefore divide the number of query heads *and* of kv heads.
"""

from __future__ import annotations

import math

from polyshard.mesh import divisors
from polyshard.tp.errors import TPShapeError
from polyshard.tp.shard import choices


def valid_tp_sizes(num_heads: int, num_kv_heads: int | None = None) -> list[int]:
    """The tp sizes that split both head counts evenly, e.g. (6, 2) -> [1, 2]."""
    return divisors(math.gcd(num_heads, num_kv_heads or num_heads))


def heads_per_rank(num_heads: int, num_kv_heads: int | None, tp: int, where: str = "") -> tuple[int, int]:
    """(query heads, kv heads) on each rank; a :class:`TPShapeError` listing valid tp sizes otherwise."""
    num_kv_heads = num_kv_heads or num_heads
    where = f" of {where}" if where else ""
    for what, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if count % tp:
            raise TPShapeError(
                f"tp={tp} does not divide {what}={count}{where}; "
                f"choose tp in {choices(valid_tp_sizes(num_heads, num_kv_heads))}"
            )
    return num_heads // tp, num_kv_heads // tp
