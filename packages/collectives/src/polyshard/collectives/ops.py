"""Plain (non-autograd) collectives along a tensor dim, each reported to the ledger.

These are the only places polyshard calls ``torch.distributed`` collectives,
so the byte ledger sees all traffic. ``group=None`` means the whole world.
Gloo and NCCL both run everything here; list-form ``all_to_all`` is avoided
because gloo cannot exchange tensors of different sizes with it.

``start_all_reduce``, ``start_all_gather`` and ``start_reduce_scatter`` post a
collective and return at once with a :class:`PendingCollective`: the caller
computes while it runs and calls ``wait()`` for the result (tensor-parallel
layers overlap their backward matmuls this way). The blocking ``all_gather``
and ``reduce_scatter`` are the same calls waited for at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from polyshard.collectives.errors import CollectiveError
from polyshard.collectives.ledger import record


def world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def rank_in(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# torch leaves its collectives' return type out (a Work when async_op, else None): hence the ignores below.
def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """In-place all-reduce; returns the work handle when ``async_op``. Over a group of one rank the
    result is the tensor itself (a sum, average, min or max of one value), so no collective runs: on
    a busy machine even that costs a wake-up of the backend's thread, and a pipeline without data
    parallelism would pay it every step (its dp and replica groups hold one rank)."""
    record("all_reduce", group, _nbytes(tensor))
    if dist.get_world_size(group) == 1:
        return _DONE if async_op else None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)  # type: ignore[no-any-return]


class _Done(dist.Work):
    """The handle of a collective that had nothing to do: already complete."""

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True


_DONE = _Done()


class PendingCollective:
    """A collective posted with ``async_op=True``. ``wait()`` blocks until it is done and returns its
    result; until then the input must not be written and the output not read. ``finish`` turns the
    raw output into the result after the wait (e.g. moves gathered pieces to their dim); ``inputs``
    are kept referenced until then, so a temporary the collective reads cannot be freed under it."""

    def __init__(
        self,
        work: dist.Work | None,
        output: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
        inputs: tuple[torch.Tensor, ...] = (),
    ):
        self._work, self._output, self._finish, self._inputs = work, output, finish, inputs

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work, self._inputs = None, ()
            if self._finish is not None:
                self._output, self._finish = self._finish(self._output), None
        return self._output


def start_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> PendingCollective:
    """Post an in-place sum of ``tensor`` over ``group``; ``wait()`` returns ``tensor``, summed."""
    return PendingCollective(all_reduce(tensor, group, async_op=True), tensor)


def all_reduce_coalesced(
    tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None, divide_by: int = 1
) -> None:
    """Sum each tensor in place over ``group`` (then divide by ``divide_by``) with one all-reduce:
    flatten them into one buffer, reduce it, copy the pieces back. Tensors may be non-contiguous
    views (a gradient inside a bucket); they share one dtype."""
    tensors = list(tensors)
    if not tensors or dist.get_world_size(group) == 1 and divide_by == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group)
    if divide_by != 1:
        flat.div_(divide_by)
    for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(piece.view_as(tensor))


def broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    """In-place broadcast from global rank ``src``."""
    record("broadcast", group, _nbytes(tensor))
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)  # type: ignore[no-any-return]


def gather_to(tensor: torch.Tensor, owner: int, group: dist.ProcessGroup) -> list[torch.Tensor] | None:
    """Every rank's ``tensor`` (one shape on all) on the rank ``owner`` of ``group`` (a group rank), in
    group-rank order; None on the other ranks. Each other rank sends its tensor once."""
    n, mine = world_size(group), rank_in(group) == owner
    record("gather", group, _nbytes(tensor), wire_bytes=0.0 if mine else float(_nbytes(tensor)))
    pieces = [torch.empty_like(tensor) for _ in range(n)] if mine else None
    dist.gather(tensor.contiguous(), pieces, group=group, group_dst=owner)
    return pieces


def scatter_from(
    out: torch.Tensor, pieces: Sequence[torch.Tensor] | None, owner: int, group: dist.ProcessGroup
) -> None:
    """Fill ``out`` on every rank of ``group`` with its piece of ``pieces``, which the rank ``owner``
    (a group rank) gives, in group-rank order (None elsewhere). The owner sends every other piece once."""
    n, mine = world_size(group), rank_in(group) == owner
    record("scatter", group, _nbytes(out), wire_bytes=float((n - 1) * _nbytes(out)) if mine else 0.0)
    dist.scatter(out, list(pieces) if pieces is not None else None, group=group, group_src=owner)


def check_divisible(size: int, n: int, what: str) -> None:
    if size % n:
        raise CollectiveError(
            f"{what} has size {size}, which does not split evenly over {n} ranks; pad it to a multiple of {n}"
        )


def all_gather(tensor: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order)."""
    return start_all_gather(tensor, dim, group).wait()


def start_all_gather(tensor: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None) -> PendingCollective:
    """Post :func:`all_gather`; ``wait()`` returns the concatenation."""
    n = world_size(group)
    if n == 1:
        return PendingCollective(None, tensor)
    tensor = tensor.contiguous()
    out = torch.empty((n * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    record("all_gather", group, _nbytes(out))
    work = dist.all_gather_single(out, tensor, group=group, async_op=True)
    if dim % tensor.dim() == 0:
        return PendingCollective(work, out, inputs=(tensor,))
    # The pieces arrive one after another along dim 0; move them to ``dim`` once they are in.
    return PendingCollective(work, out, lambda gathered: torch.cat(gathered.chunk(n, dim=0), dim=dim), (tensor,))


def all_gather_flat(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    """All-gather equal 1-D shards into ``out`` (n x shard numel); for flat ZeRO buffers."""
    record("all_gather", group, _nbytes(out))
    return dist.all_gather_single(out, tensor, group=group, async_op=async_op)  # type: ignore[no-any-return]


def reduce_scatter(
    tensor: torch.Tensor,
    dim: int = 0,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> torch.Tensor:
    """Sum ``tensor`` over the group and keep this rank's piece along ``dim``."""
    return start_reduce_scatter(tensor, dim, group, op).wait()


def start_reduce_scatter(
    tensor: torch.Tensor,
    dim: int = 0,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> PendingCollective:
    """Post :func:`reduce_scatter`; ``wait()`` returns this rank's summed piece."""
    n = world_size(group)
    if n == 1:
        return PendingCollective(None, tensor)
    check_divisible(tensor.shape[dim], n, f"reduce_scatter input dim {dim}")
    dim = dim % tensor.dim()
    # Lay the n pieces one after another along dim 0, the layout the collective splits.
    stacked = tensor.contiguous() if dim == 0 else torch.cat(tensor.chunk(n, dim=dim), dim=0)
    out_shape = list(tensor.shape)
    out_shape[dim] //= n
    out = torch.empty(out_shape, dtype=tensor.dtype, device=tensor.device)
    record("reduce_scatter", group, _nbytes(tensor))
    work = dist.reduce_scatter_single(out, stacked, op=op, group=group, async_op=True)
    return PendingCollective(work, out, inputs=(stacked,))


def reduce_scatter_flat(
    out: torch.Tensor,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce-scatter a flat buffer of n equal pieces into ``out``; for flat ZeRO buffers."""
    record("reduce_scatter", group, _nbytes(tensor))
    return dist.reduce_scatter_single(out, tensor, op=op, group=group, async_op=async_op)  # type: ignore[no-any-return]


def reduce_scatter_flat_in_place(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> tuple[torch.Tensor, dist.Work | None]:
    """Reduce-scatter a flat buffer of n equal pieces that the caller gives up: returns this rank's
    summed piece and, when ``async_op``, the handle to wait on before reading it. The rest of
    ``tensor`` holds garbage afterwards (the other pieces' sums on gloo).

    Gloo's reduce-scatter is an all-reduce of a clone of its input followed by a copy of this rank's
    piece out of it (torch 2.13's ``ProcessGroupGloo``; ``polyshard.bench.pprof --case zero1`` shows
    the two copies). With an input nobody reads again the same all-reduce runs in place and the piece
    is a view of ``tensor``: the same bytes on the wire, two copies of the buffer fewer. NCCL and the
    others run a true reduce-scatter into a new tensor. The ledger records a reduce-scatter of the
    buffer either way: the collective the algorithm asks for."""
    n = world_size(group)
    check_divisible(tensor.numel(), n, "reduce_scatter_flat_in_place input")
    if tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        record("reduce_scatter", group, _nbytes(tensor))
        work = None if n == 1 else dist.all_reduce(tensor, group=group, async_op=async_op)
        if async_op and work is None:
            work = _DONE
        return tensor.view(n, -1)[rank_in(group)], work
    out = torch.empty(tensor.numel() // n, dtype=tensor.dtype, device=tensor.device)
    return out, reduce_scatter_flat(out, tensor, group, async_op=async_op)


def split(tensor: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's equal piece of ``tensor`` along ``dim`` (no communication)."""
    n = world_size(group)
    if n == 1:
        return tensor
    check_divisible(tensor.shape[dim], n, f"split input dim {dim}")
    return tensor.chunk(n, dim=dim)[rank_in(group)].contiguous()


def all_to_all(
    tensor: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Exchange rows of ``tensor`` (dim 0): ``input_split_sizes[j]`` rows go to rank j.

    Returns ``sum(output_split_sizes)`` rows, ``output_split_sizes[j]`` from rank j.
    """
    n = world_size(group)
    if len(output_split_sizes) != n or len(input_split_sizes) != n:
        raise CollectiveError(
            f"all_to_all needs {n} split sizes per direction (one per rank), "
            f"got {len(input_split_sizes)} input and {len(output_split_sizes)} output sizes"
        )
    if sum(input_split_sizes) != tensor.shape[0]:
        raise CollectiveError(
            f"input_split_sizes sum to {sum(input_split_sizes)} but the tensor has {tensor.shape[0]} rows"
        )
    tensor = tensor.contiguous()
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    out = torch.empty((sum(output_split_sizes),) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    me = rank_in(group)
    sent_to_others = sum(s for j, s in enumerate(input_split_sizes) if j != me) * row_bytes
    record("all_to_all", group, _nbytes(tensor), wire_bytes=sent_to_others)
    dist.all_to_all_single(
        out, tensor, output_split_sizes=list(output_split_sizes), input_split_sizes=list(input_split_sizes), group=group
    )
    return out
