"""Slicing full tensors into tensor-parallel pieces, and gathering them back.

Every sharded or replicated parameter carries a
:class:`polyshard.mesh.TensorPlacement` naming the tp axis, so a checkpoint (or
:func:`gather_full_state`) knows how the local piece sits in the global tensor.

Example, tp=2, a (6, 4) weight split along dim 0: rank 0 keeps rows 0:3,
rank 1 rows 3:6. A vocabulary of 5 rows on tp=2 is padded to 6 rows; the
padding row lives on rank 1 and is dropped again on gather.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.mesh import Replicate, Shard, TensorPlacement, divisors, get_placement, set_placement
from polyshard.tp.errors import TPShapeError

SEQUENCE_PARALLEL_ATTR = "_polyshard_sequence_parallel"


def tp_size(tp_group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(tp_group)


def tp_rank(tp_group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(tp_group)


def choices(sizes: list[int]) -> str:
    """Sorted set notation for an error message: [1, 2, 3, 6] -> '{1, 2, 3, 6}'."""
    return "{" + ", ".join(str(s) for s in sorted(sizes)) + "}"


def check_divides(size: int, tp: int, what: str) -> None:
    """Raise a :class:`TPShapeError` listing the tp sizes that would work."""
    if size % tp:
        raise TPShapeError(f"tp={tp} does not divide {what}={size}; choose tp in {choices(divisors(size))}")


def padded_size(size: int, tp: int) -> int:
    """``size`` rounded up to a multiple of ``tp`` (e.g. a vocabulary of 50257 on tp=4 -> 50260)."""
    return math.ceil(size / tp) * tp


def take_shard(
    full: torch.Tensor, dim: int, tp_group: dist.ProcessGroup | None, padded: int | None = None
) -> torch.Tensor:
    """This rank's contiguous piece of ``full`` along ``dim``, zero-padding the dim to ``padded`` first."""
    if padded is not None and padded > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    tp = tp_size(tp_group)
    check_divides(full.shape[dim], tp, f"dim {dim} of a {tuple(full.shape)} tensor")
    return full.chunk(tp, dim=dim)[tp_rank(tp_group)].detach().clone()


def record_shard(
    param: torch.Tensor,
    name: str,
    global_shape: tuple[int, ...],
    dim: int,
    axis: str,
    padded_shape: tuple[int, ...] | None = None,
) -> None:
    """Attach 'sharded along ``dim`` over ``axis``' to ``param``."""
    if padded_shape is not None and tuple(padded_shape) == tuple(global_shape):
        padded_shape = None
    set_placement(param, TensorPlacement(name, tuple(global_shape), ((axis, Shard(dim)),), padded_shape=padded_shape))


def record_replicate(param: torch.Tensor, name: str, axis: str) -> None:
    """Attach 'replicated over ``axis``' to ``param``, keeping any other axes it already records."""
    old = get_placement(param)
    if old is None:
        set_placement(param, TensorPlacement(name, tuple(param.shape), ((axis, Replicate()),)))
    else:
        set_placement(param, old.with_axis(axis, Replicate()))


def gather_full_tensor(
    local: torch.Tensor, placement: TensorPlacement | None, tp_group: dist.ProcessGroup | None, axis: str = "tp"
) -> torch.Tensor:
    """The global tensor rebuilt from every rank's ``local`` piece (padding dropped).

    ``local`` may be a parameter or its gradient; a tensor without a record, or
    replicated over ``axis``, is returned as a detached copy.
    """
    local = local.detach()
    split = None if placement is None else placement.placement(axis)
    if placement is None or not isinstance(split, Shard):
        return local.clone()
    dim = split.dim
    full = ops.all_gather(local.contiguous(), dim, tp_group)
    # Drop padding rows (vocabulary padded to a multiple of tp).
    return full.narrow(dim, 0, placement.global_shape[dim]).clone()


def gather_full_state(
    model: torch.nn.Module, tp_group: dist.ProcessGroup | None, axis: str = "tp"
) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict`` of a tensor-parallel ``model``, the same on every rank.

    Keys are those of the original (unconverted) model, since :func:`parallelize`
    replaces modules in place, so ``reference.load_state_dict(full)`` works.
    Collective: call it on every rank of ``tp_group``.
    """
    by_id = {id(p): p for p in model.parameters()}
    full = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        source = by_id.get(id(tensor), tensor)
        full[key] = gather_full_tensor(source, get_placement(source), tp_group, axis)
    return full


def mark_sequence_parallel(param: torch.nn.Parameter) -> None:
    """Flag a replicated parameter that sees only a sequence shard; see ``sync_sequence_parallel_grads``."""
    setattr(param, SEQUENCE_PARALLEL_ATTR, True)


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return getattr(param, SEQUENCE_PARALLEL_ATTR, False)
