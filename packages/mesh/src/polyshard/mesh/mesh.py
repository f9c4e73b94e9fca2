"""`Mesh`: a :class:`MeshLayout` bound to this process, with its process groups.

Every group the mesh can hand out is created in the constructor, eagerly and
in the same order on every rank (``torch.distributed.new_group`` is a
collective over the whole world, so a rank that skipped or reordered a call
would deadlock the others). With k axes there are 2^k - 1 axis subsets; for
the four axes polyshard uses (dp, tp, pp, ep) that is 15 at most, and subsets
that differ only by axes of size 1 share their groups.

Example, 8 ranks with axes ordered ``[dp, tp, pp]`` (pp varies fastest)::

    mesh = Mesh({"dp": 2, "tp": 2, "pp": 2})
    mesh.ranks_in_group("dp")   # on rank 0: [0, 4]; groups [0,4] [1,5] [2,6] [3,7]
    mesh.ranks_in_group("pp")   # on rank 0: [0, 1]; groups [0,1] [2,3] [4,5] [6,7]
    mesh.ranks_in_group("tp")   # on rank 0: [0, 2]; groups [0,2] [1,3] [4,6] [5,7]
    mesh.group(("dp", "tp"))    # the group varying dp and tp: [0, 2, 4, 6] on rank 0

See :mod:`polyshard.mesh.layout` for the rank arithmetic.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from polyshard.mesh.errors import MeshError
from polyshard.mesh.layout import AxisSpec, MeshLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class Mesh:
    """Named axes over the ranks of the default process group.

    ``Mesh(axes)`` needs ``torch.distributed`` to be initialised (see
    :func:`polyshard.mesh.init_distributed`) with a world size equal to the
    product of the axis sizes. Sizes of 1 are allowed on every axis.
    """

    def __init__(self, axes: AxisSpec | MeshLayout, *, backend: str | None = None, timeout_s: float | None = None):
        self.layout = axes if isinstance(axes, MeshLayout) else MeshLayout(axes)
        if not dist.is_available() or not dist.is_initialized():
            raise MeshError(
                "torch.distributed is not initialised; call polyshard.mesh.init_distributed() "
                "before building a Mesh (use MeshLayout for rank arithmetic without processes)"
            )
        world = dist.get_world_size()
        if world != self.layout.world_size:
            raise MeshError(
                f"mesh {self.layout.as_dict()} has {self.layout.world_size} ranks but the job has "
                f"{world} processes; choose axis sizes whose product is {world}"
            )
        self.rank = dist.get_rank()
        self._groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self._partial: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup | None] = {}
        self._backend = backend
        # new_group's default is the backend's timeout, not init_process_group's: pass it to every group.
        self._timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        # Subsets that differ only by axes of size 1 hold the same ranks: create each distinct set of
        # groups once and alias the rest (dp2 x tp2 x pp2 with ep=1 needs 7 sets, not 15).
        created: dict[tuple[str, ...], dist.ProcessGroup] = {}
        for subset in self.layout.axis_subsets():
            distinct = tuple(a for a in subset if self.layout.size(a) > 1)
            if distinct not in created:
                created[distinct] = self._create_groups(subset, backend)
            self._groups[subset] = created[distinct]

    def _create_groups(self, axes: tuple[str, ...], backend: str | None) -> dist.ProcessGroup:
        mine = None
        for ranks in self.layout.groups(axes):
            if len(ranks) == self.layout.world_size:
                # The whole world, in rank order: reuse the default group.
                group = dist.group.WORLD
            else:
                group = dist.new_group(ranks, backend=backend, timeout=self._timeout)
            if self.rank in ranks:
                mine = group
        assert mine is not None  # every rank lies in exactly one group per subset
        return mine

    # -- the same questions as MeshLayout, answered for this rank ---------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        return self.layout.axis_names

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    def size(self, axes: str | Iterable[str] | None = None) -> int:
        return self.layout.size(axes)

    def coord(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        if axis not in self.layout.aliases:
            self.layout.axis_index(axis)  # a clear error for an unknown axis
        return self.layout.coords(self.rank)[axis]

    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    def group_rank(self, axes: str | Iterable[str]) -> int:
        """This rank's index inside ``group(axes)``."""
        return self.ranks_in_group(axes).index(self.rank)

    def ranks_in_group(self, axes: str | Iterable[str]) -> list[int]:
        return self.layout.ranks_in_group(axes, self.rank)

    def group(self, axes: str | Iterable[str]) -> dist.ProcessGroup:
        """Process group of the ranks that differ from this one only along ``axes``."""
        return self._groups[self.layout.normalize_axes(axes)]

    def group_at(self, axis: str, coords: Iterable[int]) -> dist.ProcessGroup | None:
        """The ranks of each ``axis`` group whose ``axis`` coordinate is in ``coords`` (other
        coordinates equal), as a process group; None on a rank outside it.

        Megatron-LM's embedding group is ``mesh.group_at("pp", [0, pp - 1])``: on
        a ``{"pp": 4, "tp": 2}`` mesh it pairs ranks [0, 6] and [1, 7], the first and
        last pipeline ranks of each tp coordinate. Created on first use and cached;
        collective: every rank calls it with the same arguments, in the same order.
        """
        wanted = tuple(sorted(set(coords)))
        size = self.layout.size(axis)
        if not wanted or any(not 0 <= c < size for c in wanted):
            raise MeshError(f"group_at({axis!r}, {list(coords)}): coordinates must lie in [0, {size})")
        key = (axis, wanted)
        if key not in self._partial:
            mine = None
            for ranks in self.layout.groups(axis):
                members = [r for r in ranks if self.layout.coords(r)[axis] in wanted]
                whole = len(members) == self.layout.world_size
                group = (
                    dist.group.WORLD if whole else dist.new_group(members, backend=self._backend, timeout=self._timeout)
                )
                if self.rank in members:
                    mine = group
            self._partial[key] = mine
        return self._partial[key]

    def name_of(self, group: dist.ProcessGroup | None) -> str:
        """What a group of this mesh is, for messages: its axes ("dp", "pp x tp"), "world", or
        "pp [0, 3]" for a ``group_at``; "unnamed" for a group the mesh did not create."""
        wanted = dist.group.WORLD if group is None else group
        for axes, mine in self._groups.items():  # the fewest axes first: plain dp's "dp", not "world"
            if mine is wanted:
                return " x ".join(a for a in axes if self.layout.size(a) > 1) or "world"
        for (axis, coords), partial in self._partial.items():
            if partial is wanted:
                return f"{axis} {list(coords)}"
        return "world" if wanted is dist.group.WORLD else "unnamed"

    def submesh(self, axes: str | Iterable[str]) -> SubMesh:
        """The mesh of an axis subset, containing this rank, sharing this mesh's groups."""
        return SubMesh(self, self.layout.normalize_axes(axes))

    # -- interop --------------------------------------------------------------
    def to_torch_device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """PyTorch's ``DeviceMesh`` with the same axes and rank layout.

        It builds its own process groups (collective over every rank), so call
        it on every rank.
        """
        from torch.distributed.device_mesh import DeviceMesh

        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        ranks = torch.arange(self.layout.world_size).reshape(self.layout.shape)
        return DeviceMesh(device_type, ranks, mesh_dim_names=self.layout.axis_names)

    def __repr__(self) -> str:
        return f"Mesh({self.layout.as_dict()}, rank={self.rank}, coords={self.coords()})"


class SubMesh:
    """A view of a :class:`Mesh` restricted to some axes (e.g. the dp x ep part).

    Its rank is this process's index inside the subset's group; ``group()``
    returns the parent's groups, so no new communicators are made.
    """

    def __init__(self, parent: Mesh, axes: tuple[str, ...]):
        self.parent = parent
        self.layout = MeshLayout([(a, parent.size(a)) for a in axes])
        self.rank = parent.group_rank(axes)

    axis_names = Mesh.axis_names
    shape = Mesh.shape
    size = Mesh.size
    coord = Mesh.coord
    coords = Mesh.coords

    def group(self, axes: str | Iterable[str]) -> dist.ProcessGroup:
        return self.parent.group(self.layout.normalize_axes(axes))

    def ranks_in_group(self, axes: str | Iterable[str]) -> list[int]:
        """Global ranks (not submesh ranks) of ``group(axes)``."""
        return self.parent.ranks_in_group(self.layout.normalize_axes(axes))

    def group_rank(self, axes: str | Iterable[str]) -> int:
        return self.parent.group_rank(self.layout.normalize_axes(axes))

    def __repr__(self) -> str:
        return f"SubMesh({self.layout.as_dict()}, rank={self.rank})"
