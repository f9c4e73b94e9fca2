"""Placement records: how a rank's local tensor maps onto the global one.

A strategy that shards or replicates a parameter attaches a
:class:`TensorPlacement` to it. The record names the global tensor, its global
shape and, per mesh axis, whether the axis replicates it or shards one of its
dims. Checkpoints save the records; resharding reads only them.

When several axes shard the same dim, the outer axis (earlier in
``placements``) splits first and the inner axis splits each outer piece, the
same nesting as the mesh's row-major rank order.

Example: a (1024, 768) weight split over ``tp=4`` along dim 0 and replicated
over ``dp=2``::

    TensorPlacement("h.0.mlp.fc.weight", (1024, 768),
                    (("dp", Replicate()), ("tp", Shard(0))))
    # the rank with tp coordinate 2 holds rows 512:768
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from polyshard.mesh.errors import PlacementError

_ATTR = "_polyshard_placement"


@dataclass(frozen=True)
class Replicate:
    """Every rank along the axis holds the same values."""

    def to_json(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """The axis splits tensor dim ``dim`` into equal contiguous pieces."""

    dim: int

    def to_json(self) -> str:
        return f"S({self.dim})"


Placement = Replicate | Shard


def placement_from_json(text: str) -> Placement:
    if text == "R":
        return Replicate()
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    raise PlacementError(f"unknown placement {text!r}; expected 'R' or 'S(dim)'")


@dataclass(frozen=True)
class TensorPlacement:
    """Global identity and layout of one local tensor.

    ``global_shape`` is the logical shape of the whole tensor. ``padded_shape``
    (defaults to ``global_shape``) is the shape the shards tile, for tensors
    padded so a dim divides evenly (e.g. a vocabulary padded to a multiple of
    tp); rows past ``global_shape`` are padding and are never exported.
    ``layer`` is the global pipeline layer the tensor belongs to, if any.
    """

    name: str
    global_shape: tuple[int, ...]
    placements: tuple[tuple[str, Placement], ...] = ()
    layer: int | None = None
    padded_shape: tuple[int, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        if self.padded_shape is not None:
            object.__setattr__(self, "padded_shape", tuple(int(s) for s in self.padded_shape))
            if len(self.padded_shape) != len(self.global_shape) or any(
                p < g for p, g in zip(self.padded_shape, self.global_shape)
            ):
                raise PlacementError(
                    f"{self.name}: padded_shape {self.padded_shape} must have the rank of "
                    f"global_shape {self.global_shape} and be at least as large on every dim"
                )
        object.__setattr__(self, "placements", tuple(self.placements))
        for axis, placement in self.placements:
            if isinstance(placement, Shard) and not 0 <= placement.dim < len(self.global_shape):
                raise PlacementError(
                    f"{self.name}: axis {axis!r} shards dim {placement.dim} but the tensor has "
                    f"{len(self.global_shape)} dims"
                )

    @property
    def tiled_shape(self) -> tuple[int, ...]:
        return self.padded_shape or self.global_shape

    def placement(self, axis: str) -> Placement:
        return dict(self.placements).get(axis, Replicate())

    def with_axis(self, axis: str, placement: Placement) -> TensorPlacement:
        """A copy with ``axis`` set (appended if new, so list outer axes first)."""
        items = dict(self.placements)
        items[axis] = placement
        return TensorPlacement(self.name, self.global_shape, tuple(items.items()), self.layer, self.padded_shape)

    def local_shape(self, axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
        shape = list(self.tiled_shape)
        for axis, placement in self.placements:
            if isinstance(placement, Shard):
                shape[placement.dim] //= axis_sizes[axis]
        return tuple(shape)

    def local_slices(self, axis_sizes: Mapping[str, int], coords: Mapping[str, int]) -> tuple[slice, ...]:
        """Slices of the (padded) global tensor held by the rank at ``coords``."""
        start = [0] * len(self.tiled_shape)
        length = list(self.tiled_shape)
        for axis, placement in self.placements:
            if not isinstance(placement, Shard):
                continue
            n = axis_sizes[axis]
            if length[placement.dim] % n:
                raise PlacementError(
                    f"{self.name}: dim {placement.dim} of size {length[placement.dim]} does not split "
                    f"evenly over {axis}={n}; pad the dim to a multiple of {n}"
                )
            length[placement.dim] //= n
            start[placement.dim] += coords[axis] * length[placement.dim]
        return tuple(slice(s, s + n) for s, n in zip(start, length))

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "name": self.name,
            "global_shape": list(self.global_shape),
            "placements": {axis: p.to_json() for axis, p in self.placements},
        }
        if self.layer is not None:
            out["layer"] = self.layer
        if self.padded_shape is not None:
            out["padded_shape"] = list(self.padded_shape)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorPlacement:
        return cls(
            name=data["name"],
            global_shape=tuple(data["global_shape"]),
            placements=tuple((a, placement_from_json(p)) for a, p in data["placements"].items()),
            layer=data.get("layer"),
            padded_shape=tuple(data["padded_shape"]) if "padded_shape" in data else None,
        )


def set_placement(tensor: torch.Tensor, record: TensorPlacement) -> torch.Tensor:
    """Attach ``record`` to ``tensor`` (a parameter or buffer) and return the tensor."""
    if not isinstance(record, TensorPlacement):
        raise PlacementError(f"expected a TensorPlacement, got {type(record).__name__}")
    setattr(tensor, _ATTR, record)
    return tensor


def get_placement(tensor: torch.Tensor) -> TensorPlacement | None:
    """The record attached by :func:`set_placement`, or None for a plain tensor."""
    return getattr(tensor, _ATTR, None)


def shard_tensor(
    full: torch.Tensor, record: TensorPlacement, axis_sizes: Mapping[str, int], coords: Mapping[str, int]
) -> torch.Tensor:
    """The local piece of ``full`` (the padded global tensor) for the rank at ``coords``."""
    if tuple(full.shape) != record.tiled_shape:
        raise PlacementError(f"{record.name}: tensor has shape {tuple(full.shape)}, record says {record.tiled_shape}")
    return full[record.local_slices(axis_sizes, coords)].clone()
