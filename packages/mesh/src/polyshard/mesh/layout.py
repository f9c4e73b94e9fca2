"""Pure rank <-> coordinate arithmetic for an N-D mesh; no process groups.

The layout is row-major: axes are listed outermost first and the *last* axis
varies fastest, so ranks that differ only in the last axis are neighbours
(put ``tp`` last to keep tensor-parallel groups on one node).

Worked example: 8 ranks, ``MeshLayout({"pp": 2, "dp": 2, "tp": 2})``::

    rank:  0  1  2  3  4  5  6  7
    pp:    0  0  0  0  1  1  1  1
    dp:    0  0  1  1  0  0  1  1
    tp:    0  1  0  1  0  1  0  1

    tp groups (vary tp only):  [0, 1] [2, 3] [4, 5] [6, 7]
    dp groups (vary dp only):  [0, 2] [1, 3] [4, 6] [5, 7]
    pp groups (vary pp only):  [0, 4] [1, 5] [2, 6] [3, 7]
    pp x dp groups:            [0, 2, 4, 6] [1, 3, 5, 7]
    pp x tp groups:            [0, 1, 4, 5] [2, 3, 6, 7]
    dp x tp groups:            [0, 1, 2, 3] [4, 5, 6, 7]
    pp x dp x tp group:        [0, 1, 2, 3, 4, 5, 6, 7]

A group that varies several axes lists its ranks in ascending order, which is
also the row-major order of the varying coordinates.

Split axes: an axis ``X`` may be laid out as two, ``X_replicate`` (outer) and
``X_shard`` (inner, so a shard group is neighbouring ranks), e.g. hybrid
sharded data parallelism's ``dp_replicate x dp_shard``. The layout then also
answers for ``X`` as for the pair: ``size("dp")`` is their product,
``ranks_in_group("dp", r)`` varies both, and ``coords(r)["dp"]`` is the
row-major coordinate ``replicate * size(X_shard) + shard``. With
``{"dp_replicate": 2, "dp_shard": 2, "tp": 2}``::

    rank:          0  1  2  3  4  5  6  7
    dp_replicate:  0  0  0  0  1  1  1  1
    dp_shard:      0  0  1  1  0  0  1  1
    dp (alias):    0  0  1  1  2  2  3  3
    dp_shard groups: [0, 2] [1, 3] [4, 6] [5, 7]; dp_replicate: [0, 4] [1, 5] [2, 6] [3, 7]
    dp groups:       [0, 2, 4, 6] [1, 3, 5, 7]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

from polyshard.mesh.errors import MeshError

AxisSpec = Mapping[str, int] | Sequence[tuple[str, int]]
REPLICATE_SUFFIX, SHARD_SUFFIX = "_replicate", "_shard"
"""An axis ``X`` split in two is named ``X_replicate`` and ``X_shard`` (see the module docstring)."""


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending: the axis sizes that split ``n`` evenly (for
    messages such as 'choose tp in [1, 2, 3, 6]')."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _as_axis_tuple(axes: str | Iterable[str]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


class MeshLayout:
    """Named axes with sizes; maps ranks to coordinates and lists groups."""

    def __init__(self, axes: AxisSpec):
        items = list(axes.items()) if isinstance(axes, Mapping) else list(axes)
        if not items:
            raise MeshError("a mesh needs at least one axis, e.g. {'dp': 2}")
        names = [name for name, _ in items]
        for name, size in items:
            if not isinstance(name, str) or not name:
                raise MeshError(f"axis names must be non-empty strings; got {name!r} in {names}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshError(f"axis {name!r} has size {size!r}; sizes must be integers >= 1")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise MeshError(f"duplicate axis names {duplicates} in {names}; each axis needs its own name")
        self.axis_names: tuple[str, ...] = tuple(names)
        self.shape: tuple[int, ...] = tuple(size for _, size in items)
        self.world_size: int = math.prod(self.shape)
        self.aliases: dict[str, tuple[str, str]] = self._split_axes(names)

    @staticmethod
    def _split_axes(names: list[str]) -> dict[str, tuple[str, str]]:
        """``X`` -> (``X_replicate``, ``X_shard``) for every axis split in two (replicate outer)."""
        out = {}
        for name in names:
            if not name.endswith(REPLICATE_SUFFIX):
                continue
            base = name[: -len(REPLICATE_SUFFIX)]
            shard = base + SHARD_SUFFIX
            if shard not in names:
                continue
            if base in names:
                raise MeshError(f"axes {base!r}, {name!r} and {shard!r}: {base!r} is already the pair's name; drop it")
            if names.index(shard) < names.index(name):
                raise MeshError(f"axis {name!r} must come before {shard!r} (shard groups are the inner, faster axis)")
            out[base] = (name, shard)
        return out

    def expand(self, axes: str | Iterable[str]) -> tuple[str, ...]:
        """``axes`` with every split axis's name replaced by its two parts (no validation)."""
        return tuple(part for a in _as_axis_tuple(axes) for part in self.aliases.get(a, (a,)))

    # -- axes -----------------------------------------------------------------
    def size(self, axes: str | Iterable[str] | None = None) -> int:
        """Number of ranks along ``axes`` (all axes when None)."""
        if axes is None:
            return self.world_size
        return math.prod(self.shape[self.axis_index(a)] for a in self.expand(axes))

    def axis_index(self, axis: str) -> int:
        if axis not in self.axis_names:
            known = list(self.axis_names) + [f"{a} (= {' x '.join(p)})" for a, p in self.aliases.items()]
            raise MeshError(f"unknown mesh axis {axis!r}; this mesh has axes {known}")
        return self.axis_names.index(axis)

    def normalize_axes(self, axes: str | Iterable[str]) -> tuple[str, ...]:
        """Validate ``axes`` and return them in mesh order (outermost first); a split axis's name
        stands for its two parts."""
        axes = self.expand(axes)
        if not axes:
            raise MeshError("a group needs at least one axis")
        if len(set(axes)) != len(axes):
            raise MeshError(f"axis listed twice in {axes}")
        for axis in axes:
            self.axis_index(axis)
        return tuple(a for a in self.axis_names if a in axes)

    # -- ranks and coordinates ------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of ``rank`` along every axis (then along each split axis's name, e.g. ``dp``)."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside this mesh of {self.world_size} ranks")
        coords = {}
        for name, size in zip(reversed(self.axis_names), reversed(self.shape)):
            coords[name] = rank % size
            rank //= size
        out = {name: coords[name] for name in self.axis_names}
        for alias, (outer, inner) in self.aliases.items():
            out[alias] = out[outer] * self.size(inner) + out[inner]
        return out

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Inverse of :meth:`coords`; every axis must be given."""
        missing = [a for a in self.axis_names if a not in coords]
        if missing:
            raise MeshError(f"coordinate is missing axes {missing}")
        rank = 0
        for name, size in zip(self.axis_names, self.shape):
            c = coords[name]
            if not 0 <= c < size:
                raise MeshError(f"coordinate {name}={c} is outside 0..{size - 1}")
            rank = rank * size + c
        return rank

    # -- groups ---------------------------------------------------------------
    def ranks_in_group(self, axes: str | Iterable[str], rank: int) -> list[int]:
        """Ranks sharing ``rank``'s coordinates on every axis except ``axes``."""
        axes = self.normalize_axes(axes)
        base = self.coords(rank)
        ranks = []
        for values in itertools.product(*(range(self.size(a)) for a in axes)):
            base.update(zip(axes, values))
            ranks.append(self.rank_of(base))
        return sorted(ranks)

    def groups(self, axes: str | Iterable[str]) -> list[list[int]]:
        """Every group that varies ``axes``, ordered by its lowest rank."""
        seen: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            group = self.ranks_in_group(axes, rank)
            seen.setdefault(group[0], group)
        return [seen[k] for k in sorted(seen)]

    def axis_subsets(self) -> list[tuple[str, ...]]:
        """Every non-empty subset of axes, in a fixed order (by size, then mesh order)."""
        return [
            subset for k in range(1, len(self.axis_names) + 1) for subset in itertools.combinations(self.axis_names, k)
        ]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshLayout) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.as_dict().items()))

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape))

    def __repr__(self) -> str:
        return "MeshLayout(" + ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape)) + ")"
