"""Rank-major flat layout: how a list of parameters is sharded over N ranks along dim 0.

Every parameter is padded on dim 0 to a multiple of N and cut into N equal row
blocks; rank r holds block r of every parameter. A *flat* buffer of the whole
list is laid out rank-major, so one collective serves all of them::

    params p (5, 2) and q (3,) over N = 2 ranks
    p padded to (6, 2): rank 0 holds rows 0:3, rank 1 rows 3:6 (row 5 is padding)
    q padded to (4,):   rank 0 holds 0:2,      rank 1 holds 2:4  (element 3 is padding)
    flat buffer (N * 8): [p rows 0:3 | q 0:2 | p rows 3:6 | q 2:4]
                          ---- rank 0 (8) --  ---- rank 1 (8) ---

``reduce_scatter`` of the flat buffer leaves each rank its own 8 elements;
``all_gather`` of the 8-element shards rebuilds the flat buffer. The same
per-parameter sharding is what the placement records describe
(``Shard(0)`` with ``padded_shape``), so checkpoints can reshard it. With
N = 1 the layout is plain concatenation (used by the all-reduce buckets).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from polyshard.mesh import Shard, TensorPlacement


@dataclass(frozen=True)
class ShardSpec:
    """One parameter's dim-0 sharding over ``n`` ranks (0-dim tensors count as shape (1,))."""

    shape: tuple[int, ...]
    n: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def rest(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def rows_per_rank(self) -> int:
        return math.ceil(self.rows / self.n)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.rows_per_rank, *self.rest)

    @property
    def shard_numel(self) -> int:
        return math.prod(self.shard_shape)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return (self.rows_per_rank * self.n, *self.rest)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.n

    def padded(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (any shape == self.shape) as (n, shard_numel), padding rows with zeros."""
        rows = full.reshape(self.rows, *self.rest)
        pad = self.rows_per_rank * self.n - self.rows
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, *self.rest)])
        return rows.reshape(self.n, self.shard_numel)

    def shard_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s row block of ``full``, shape ``shard_shape`` (a copy)."""
        return self.padded(full)[rank].reshape(self.shard_shape).clone()


class FlatLayout:
    """Offsets of several parameters inside one rank-major flat buffer (see module doc)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], n: int):
        self.n = n
        self.specs = [ShardSpec(tuple(s), n) for s in shapes]
        self.offsets = []
        offset = 0
        for spec in self.specs:
            self.offsets.append(offset)
            offset += spec.shard_numel
        self.shard_numel = offset  # elements each rank holds
        self.numel = offset * n  # elements of the full flat buffer, padding included

    @property
    def padding_numel(self) -> int:
        return self.numel - sum(math.prod(s.shape) for s in self.specs)

    def _grid(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (numel,) as (n, shard_numel); a 2-D tensor is taken as that grid already (it may be
        the leading columns of a wider buffer, as when gradients travel with presence flags)."""
        return flat if flat.dim() == 2 else flat.view(self.n, self.shard_numel)

    def pack(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor) -> torch.Tensor:
        """Write full tensors (None = zeros) into ``out`` (numel,) in rank-major order."""
        grid = self._grid(out)
        for spec, offset, t in zip(self.specs, self.offsets, tensors):
            piece = grid[:, offset : offset + spec.shard_numel]
            if t is None:
                piece.zero_()
            else:
                piece.copy_(spec.padded(t))
        return out

    def unpack(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index`` rebuilt from a full flat buffer or its grid (a view when n == 1)."""
        spec, offset = self.specs[index], self.offsets[index]
        piece = self._grid(flat)[:, offset : offset + spec.shard_numel]
        rows = piece.reshape(spec.n * spec.rows_per_rank, *spec.rest)[: spec.rows]
        return rows.reshape(spec.shape)

    def shard_view(self, shard: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s rows inside this rank's shard (shard_numel,), as a view."""
        spec, offset = self.specs[index], self.offsets[index]
        return shard[offset : offset + spec.shard_numel].view(spec.shard_shape)


def master_rows(
    dtype: torch.dtype, rows: Callable[[], torch.Tensor], full: torch.Tensor, spec: ShardSpec, rank: int
) -> torch.Tensor:
    """The float32 rows an optimizer steps for one parameter on ``rank`` (shape ``spec.shard_shape``).

    ``rows()`` gives the rows the wrapper itself keeps, in ``dtype``, and
    all-gathers from (ZeRO-3: a view of its flat shard; stages 0-2: a view of
    the parameter's storage). When ``dtype`` is float32 they *are* the master:
    the optimizer steps them in place and no second copy exists, so the bytes
    held are the ZeRO formulas'. Otherwise (mixed precision, or a low-precision
    model) the master is a float32 copy cut from ``full``, the parameter's
    value before any cast, and ``rows`` is not called.
    """
    return rows() if dtype == torch.float32 else spec.shard_of(full.float(), rank)


def write_rows(rows: torch.Tensor, value: torch.Tensor) -> None:
    """Copy an optimizer's result into ``rows``; nothing to do when it stepped ``rows`` in place."""
    if value.data_ptr() != rows.data_ptr():
        rows.copy_(value)


def rows_view(param: torch.Tensor, spec: ShardSpec, rank: int, home: torch.Tensor | None = None) -> torch.Tensor:
    """Rank ``rank``'s rows of ``param`` (shape ``spec.shard_shape``) as a view of its storage.

    That needs the storage to hold ``spec.padded_shape`` contiguously: when
    dim 0 divides by ``spec.n`` (and ``param`` is contiguous) it already does;
    otherwise ``home`` must be that storage, a flat tensor of the padded numel
    whose first ``param.numel()`` elements ``param`` views (see :func:`padded_home`).
    """
    if home is None:
        if param.numel() != spec.padded_numel or not param.is_contiguous():
            raise ValueError(f"rows of a {tuple(param.shape)} parameter over {spec.n} ranks need a padded home")
        home = param.detach().view(spec.padded_numel)
    return home[rank * spec.shard_numel : (rank + 1) * spec.shard_numel].view(spec.shard_shape)


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is a view into ``b``'s memory (keeping ``a`` keeps all of ``b`` alive)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def padded_home(param: torch.nn.Parameter, spec: ShardSpec) -> torch.Tensor:
    """Move ``param`` into new storage of ``spec.padded_shape``'s numel (its value first, zeros after)
    and return that storage as a flat tensor, so :func:`rows_view` can cut every rank's rows from it."""
    home = param.new_zeros(spec.padded_numel)
    home[: param.numel()].copy_(param.detach().reshape(-1))
    param.data = home[: param.numel()].view(param.shape)
    return home


def shard_record(
    base: TensorPlacement | None, name: str, spec: ShardSpec, axis: str | tuple[str, ...]
) -> TensorPlacement:
    """Placement of a dim-0 shard over ``axis``, on top of the record ``base`` the parameter already
    has (None: none). It depends only on records and shapes, so offline tools call it too.

    ``axis`` may name several mesh axes (outer first) when the data-parallel
    group spans them, e.g. ``("dp", "ep")``: the group's rank order is the
    row-major order of those coordinates, so each axis shards dim 0 in turn.

    A parameter that tp/pp/ep already sharded keeps its record and gains
    ``axis -> Shard(0)`` appended (dp splits each existing piece: the inner
    split). dp's padding of dim 0 is recorded as ``padded_shape`` when no
    other axis shards dim 0; when one does, the record cannot express the
    padding of each inner piece and the dim must divide evenly.
    """
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    others = () if base is None else tuple((a, p) for a, p in base.placements if a not in axes)
    layer = None if base is None else base.layer
    global_shape = (spec.shape or (1,)) if base is None else base.global_shape
    tiled = global_shape if base is None else base.tiled_shape
    dim0_sharded_elsewhere = any(isinstance(p, Shard) and p.dim == 0 for _, p in others)
    padded = None
    if not dim0_sharded_elsewhere and spec.padded_shape[0] != tiled[0]:
        padded = (spec.padded_shape[0], *tiled[1:])
    elif base is not None and base.padded_shape is not None:
        padded = base.padded_shape
    sharded = tuple((a, Shard(0)) for a in axes)
    return TensorPlacement(base.name if base else name, global_shape, (*others, *sharded), layer, padded)


class GradBuffer:
    """A flat gradient buffer whose every rank row ends with one presence flag per parameter.

    Reducing gradients also has to say *whether* anyone produced one: a parameter
    that no rank used this step must keep ``grad = None`` (so AdamW neither decays
    nor moves it, as on one process and under PyTorch's DDP), while zeros from
    the ranks that did not use it still count in the average. Each rank writes
    1 or 0 per parameter into the flag columns of every row, so the same
    all-reduce or reduce-scatter that sums the gradients also counts, per
    parameter, the ranks that had one; no extra collective runs::

        layout rows (n = 2):  [ p rows | q rows | flag p  flag q ]   rank 0's row
                              [ p rows | q rows | flag p  flag q ]   rank 1's row
    """

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.flags = len(layout.specs)
        self.row_numel = layout.shard_numel + self.flags  # one rank row: gradient columns, then flags
        self.data = torch.empty(layout.n * self.row_numel, dtype=dtype, device=device)

    @property
    def grid(self) -> torch.Tensor:
        """The gradient columns, (n, shard_numel), for :meth:`FlatLayout.pack` and ``unpack``."""
        return self.data.view(self.layout.n, self.row_numel)[:, : self.layout.shard_numel]

    def pack(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Write the gradients (None = zeros) and their presence flags."""
        self.layout.pack(grads, self.grid)
        present = torch.tensor([g is not None for g in grads], dtype=self.data.dtype)
        self.data.view(self.layout.n, self.row_numel)[:, self.layout.shard_numel :].copy_(present.to(self.data.device))

    def split(self, reduced: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
        """A reduced row (row_numel,) -> (its gradient columns, per parameter: did any rank have one)."""
        cut = self.layout.shard_numel
        return reduced[:cut], (reduced[cut:] > 0).tolist()
