"""Checks run once at wrap time, before any gradient moves."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.dp.errors import ParameterMismatchError


def _signature(name: str, tensor: torch.Tensor) -> int:
    """A 31-bit fingerprint of name, shape and dtype (equal on every rank for the same model)."""
    return zlib.crc32(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode()) & 0x7FFFFFFF


def check_same_on_all_ranks(named: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    """Raise :class:`ParameterMismatchError` naming the first tensor that differs across ``group``.

    Two all-reduces (MIN and MAX) of the fingerprints: they agree everywhere
    exactly when every rank has the same names, shapes and dtypes. The count is
    compared first so the fingerprint tensors have the same length.
    """
    # Collectives run on the tensors' device (NCCL cannot reduce CPU tensors).
    device = named[0][1].device if named else torch.device("cpu")
    count = torch.tensor([len(named), -len(named)], dtype=torch.int64, device=device)
    ops.all_reduce(count, group, op=dist.ReduceOp.MAX)
    if count[0] != -count[1]:
        raise ParameterMismatchError(
            f"this rank has {len(named)} tensors to wrap but another rank of the group has "
            f"{int(count[0]) if count[0] != len(named) else int(-count[1])}; every rank must build the same model"
        )
    prints = torch.tensor([_signature(n, t) for n, t in named], dtype=torch.int64, device=device)
    low, high = prints.clone(), prints.clone()
    ops.all_reduce(low, group, op=dist.ReduceOp.MIN)
    ops.all_reduce(high, group, op=dist.ReduceOp.MAX)
    for (name, tensor), lo, hi in zip(named, low.tolist(), high.tolist()):
        if lo != hi:
            raise ParameterMismatchError(
                f"{name!r} has shape {tuple(tensor.shape)} and dtype {tensor.dtype} on rank {dist.get_rank()} "
                "but a different name, shape or dtype on another rank of the group; build the same model "
                "(same config) on every rank before wrapping it"
            )


def broadcast_from_first(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Copy every tensor from the group's first rank to the others (in place)."""
    src = dist.get_process_group_ranks(group)[0] if group is not dist.group.WORLD else 0
    with torch.no_grad():
        for t in tensors:
            ops.broadcast(t.data, src, group)


def replicas_of(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` if it holds other replicas to all-reduce with, else None (a group of one rank is
    no replication: nothing runs, and nothing is recorded in the ledger, as without hybrid sharding)."""
    return group if group is not None and dist.get_world_size(group) > 1 else None


def broadcast_and_check(
    named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup, replicate_group: dist.ProcessGroup | None
) -> None:
    """Check ``named`` agree in names and shapes over ``group`` (and ``replicate_group``) and give every
    rank the values of the first rank of both: broadcast inside each shard group, then across replicas."""
    for g in (group, replicate_group):
        if g is not None:
            check_same_on_all_ranks(named, g)
            broadcast_from_first([t for _, t in named], g)
