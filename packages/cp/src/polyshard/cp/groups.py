"""The two process groups of the 2-D context-parallel scheme, cp = u x r (Ulysses x ring).

The tokens are sharded over the whole cp group (cp rank c holds chunks c and 2cp-1-c). Cp rank
c = j u + i has Ulysses index i and ring index j: its all-to-all group is the u neighbouring cp ranks
of the same j, its ring the r cp ranks of the same i (why this order: :mod:`polyshard.cp.ulysses`).

Worked example, cp group [0, 1, 2, 3] (global ranks), u=2: Ulysses groups [0, 1] and [2, 3], rings
[0, 2] and [1, 3]. Two cp groups [0, 2, 4, 6] and [1, 3, 5, 7] (cp the outer mesh axis), u=2: Ulysses
groups [0, 2] [4, 6] [1, 3] [5, 7], rings [0, 4] [2, 6] [1, 5] [3, 7].
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch.distributed as dist

from polyshard.cp.errors import ContextParallelError
from polyshard.mesh import divisors


def split_context_group(ranks: Sequence[int], ulysses: int) -> tuple[list[list[int]], list[list[int]]]:
    """One cp group's global ranks (in cp order) -> (its Ulysses groups, its rings); no processes needed."""
    cp = len(ranks)
    if ulysses < 1 or cp % ulysses:
        raise ContextParallelError(
            f"cp_ulysses={ulysses} does not divide cp={cp}: the cp ranks form a cp_ulysses x ring grid; "
            f"choose cp_ulysses in {divisors(cp)}"
        )
    rings = cp // ulysses
    inner = [list(ranks[j * ulysses : (j + 1) * ulysses]) for j in range(rings)]
    outer = [list(ranks[i::ulysses]) for i in range(ulysses)]
    return inner, outer


def ulysses_ring_groups(
    cp_groups: Sequence[Sequence[int]], ulysses: int, *, timeout: datetime.timedelta | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (Ulysses group, ring group), given every cp group of the job (the same list on every
    rank: ``new_group`` is collective over the world, so every rank creates every group, in one order)."""
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for ranks in cp_groups:
        inner, outer = split_context_group(ranks, ulysses)
        for kind, groups in (("ulysses", inner), ("ring", outer)):
            for members in groups:
                group = dist.new_group(members, timeout=timeout)
                if me in members:
                    mine[kind] = group
    if set(mine) != {"ulysses", "ring"}:
        raise ContextParallelError(f"rank {me} is in none of the cp groups {list(map(list, cp_groups))}")
    return mine["ulysses"], mine["ring"]
