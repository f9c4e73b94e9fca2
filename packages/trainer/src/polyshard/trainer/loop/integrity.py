"""Checks on the weights themselves: finite before they are saved, equal across data-parallel replicas.

Data-parallel replicas apply the same averaged gradients to the same weights, so they hold bitwise
equal parameters. A replica that drifts (a faulty device, a reduction it missed) trains on silently
and its errors reach every checkpoint; a checksum per rank, gathered over the dp group, finds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import cast

import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.dp import FullyShardedDataParallel
from polyshard.trainer.checkpointing.records import model_buffers
from polyshard.trainer.checkpointing.state import persistent_buffers
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.errors import ReplicaMismatchError

# A float's bits read as a signed integer of the same width, so a checksum sees every bit.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of the tensors' bit patterns (as integers, in int64 with wrap-around): equal tensors give
    equal sums on any rank, and any single changed element changes the sum."""
    total = torch.zeros((), dtype=torch.int64)
    for t in tensors:
        if t.numel():
            bits = t.detach().contiguous().view(_BITS[t.element_size()])
            total += bits.to(torch.int64).sum().cpu()
    return int(total)


def check_replicas(engine: Engine, step: int) -> None:
    """Raise :class:`ReplicaMismatchError` on every rank when the replicas of any dp group hold different
    parameters, or the ranks of one pipeline stage different buffers (a sigmoid router's bias, which
    every rank updates alike), naming the ranks that differ from their group's majority. One
    all-gather of one int64 per rank over dp (and one over the stage's ranks when the model has
    buffers), then one all-reduce of a per-rank flag over the world, so every rank stops at the same
    check (a rank that went on alone would wait in the next collective forever).

    ZeRO-3 keeps no parameter replicas (each dp rank holds its own rows), so only buffers are compared."""
    par = engine.config.parallel
    compare_parameters = par.dp > 1 and par.zero_stage < 3
    stage_axes = (*par.replica_axes, "tp")  # every rank of a pipeline stage holds the same buffers
    # Decided from the model, not this rank's stages (one may hold none): every rank joins the last all-reduce.
    compare_buffers = engine.mesh.size(stage_axes) > 1 and bool(model_buffers(engine.config))
    if not compare_parameters and not compare_buffers:
        return
    # Per global rank: 1 differs from its group's majority, 2 its group has no majority.
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=engine.device)
    if compare_parameters:
        mine = checksum(p for stage in engine.stages.values() for p in stage.parameters())
        _flag_odd_ranks(engine, mine, ("dp",), flags)
    buffers = [b for stage in engine.stages.values() for _, b in persistent_buffers(stage)]
    if compare_buffers and buffers:  # the ranks of a stage hold the same layers: all or none of them gather
        _flag_odd_ranks(engine, checksum(buffers), stage_axes, flags)
    ops.all_reduce(flags, op=dist.ReduceOp.MAX)
    odd, unsure = (torch.nonzero(flags == v).flatten().tolist() for v in (1, 2))
    if not odd and not unsure:
        return
    who = f"rank(s) {odd} differ from the other replicas of their group" if odd else ""
    if unsure:
        who += ("; " if who else "") + f"ranks {unsure} disagree with no majority"
    raise ReplicaMismatchError(
        f"step {step}: replicas hold different parameters or buffers: {who}. A faulty device or a "
        f"missed reduction; this step was not saved. Resume from the last checkpoint, away from those ranks' "
        f"devices if the fault repeats"
    )


def _flag_odd_ranks(engine: Engine, mine: int, axes: tuple[str, ...], flags: torch.Tensor) -> None:
    """Gather each rank's checksum over the ``axes`` group and flag (in ``flags``, by global rank) the
    ones that differ from the group's majority (1), or every rank of a group without one (2)."""
    group = engine.mesh.group(axes)
    sums = ops.all_gather(torch.tensor([mine], dtype=torch.int64, device=engine.device), 0, group).tolist()
    if len(set(sums)) == 1:
        return
    majority, count = Counter(sums).most_common(1)[0]
    for rank, value in zip(engine.mesh.ranks_in_group(axes), sums):
        if count * 2 <= len(sums):
            flags[rank] = max(int(flags[rank]), 2)
        elif value != majority:
            flags[rank] = max(int(flags[rank]), 1)


def weights_finite(engine: Engine) -> bool:
    """Whether every rank's parameters (and fp32 masters) are finite: one all-reduce of a flag."""
    if engine.shards_parameters:  # the rows live outside the (freed) parameters
        # ZeRO-3's wrappers are FullyShardedDataParallel.
        tensors = [
            t for w in engine.wrappers.values() for t in cast(FullyShardedDataParallel, w).local_shards().values()
        ]
    else:
        tensors = [t for stage in engine.stages.values() for t in stage.parameters() if t.is_floating_point()]
    tensors += [master for opt in engine.optimizers for master in getattr(opt, "masters", {}).values()]
    finite = all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())
    flag = torch.tensor([1.0 if finite else 0.0], device=engine.device)
    ops.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
