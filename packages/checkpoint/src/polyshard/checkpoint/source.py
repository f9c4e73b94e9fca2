"""Reading checkpoints: the :class:`CheckpointSource` protocol and :class:`Checkpoint`, a verified one.

Whatever fills a rank's tensors (an online reshard while loading, the offline reshard, export)
asks a source for regions of global tensors by key; it never needs to know which rank saved
what. Two kinds of source implement the protocol: :class:`Checkpoint` (a polyshard checkpoint
folder on any mesh) and :class:`polyshard.checkpoint.hf.HFWeights` (a Hugging Face model
folder: weights only).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from polyshard.checkpoint.format import (
    ASSETS,
    DTYPES,
    MASTER,
    MODEL,
    OPTIM,
    RNG,
    CheckpointError,
    read_index,
    verify_files,
)
from polyshard.mesh import MeshLayout, PlacementError, TensorPlacement


class CheckpointSource(Protocol):
    """What a reader of global tensors asks of a checkpoint, whatever its format."""

    folder: Path

    def resolve(self, key: str) -> str:
        """The stored key that holds ``key``'s values (a CheckpointError when none does)."""
        ...

    def global_shape(self, key: str) -> tuple[int, ...]:
        """The global (unsharded, unpadded) shape of ``key``."""
        ...

    def read(self, key: str, start: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The region ``start`` + ``shape`` of the global tensor ``key``, zero past its global shape."""
        ...

    def optim_state(self) -> dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        """Parameter name -> {state key: (dtype, global shape)} of the saved optimizer state."""
        ...

    def rng_piece(self, coords: Mapping[str, int]) -> Piece | None:
        """The generator state a rank at ``coords`` continues with (None: start fresh)."""
        ...

    def read_piece(self, piece: Piece, key: str, local: tuple[slice, ...] = ()) -> torch.Tensor:
        """The part ``local`` (default: all) of one saved piece (one :meth:`rng_piece` returned)."""
        ...


@dataclass(frozen=True)
class Piece:
    """One rank's saved piece of a global tensor: which file holds it and which region it covers."""

    rank: int
    record: TensorPlacement | None
    shape: tuple[int, ...]  # as stored
    dtype: torch.dtype


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """A safetensors file opened for lazy reads; a damaged one is a CheckpointError naming it."""
    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from err
    with handle as f:
        yield f


class Checkpoint:
    """A polyshard checkpoint folder, verified (every file's sha256) and opened to read any region
    of any of its global tensors."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.index = read_index(self.folder)
        verify_files(self.folder, self.index)
        self.layout = MeshLayout(self.index["mesh"])
        self.sizes = self.layout.as_dict()
        self.pieces: dict[str, list[Piece]] = {}
        for rank, entry in enumerate(self.index["ranks"]):
            path = self.folder / entry["file"]
            with _opened(path) as f:
                for key, record in entry["tensors"].items():
                    if key not in f.keys():
                        raise CheckpointError(f"{path} holds no tensor {key!r}, which index.json lists for it")
                    stored = f.get_slice(key)
                    try:
                        placement = TensorPlacement.from_json(record) if record is not None else None
                    except (KeyError, TypeError, ValueError, AttributeError, PlacementError) as err:
                        raise CheckpointError(
                            f"{self.folder}/index.json: the record of {key!r} is malformed: {err}"
                        ) from err
                    self.pieces.setdefault(key, []).append(
                        Piece(rank, placement, tuple(stored.get_shape()), DTYPES[stored.get_dtype()])
                    )
        for key, pieces in self.pieces.items():
            # The records say how big each tensor is; the files say how much was stored. A record that
            # claims more than all pieces together hold is refused before anything is allocated.
            claimed = math.prod(self.global_shape(key))
            if claimed > sum(math.prod(p.shape) for p in pieces):
                raise CheckpointError(
                    f"{self.folder}/index.json: {key!r} claims a global shape {list(self.global_shape(key))} "
                    "larger than all its saved pieces together"
                )

    def asset(self, name: str) -> Path | None:
        """The verified asset ``name`` saved with this checkpoint (e.g. :data:`TOKENIZER`), or None."""
        return self.folder / name if name in self.index.get(ASSETS, {}) else None

    def assets(self) -> dict[str, Path]:
        return {name: self.folder / name for name in self.index.get(ASSETS, {})}

    @property
    def settings(self) -> dict[str, Any]:
        """The settings of the run that saved the checkpoint, as the trainer wrote them (a table)."""
        settings = self.index.get("config")
        if not isinstance(settings, dict):
            raise CheckpointError(f"{self.folder}/index.json records no config; it cannot be laid out on another mesh")
        return settings

    @property
    def step(self) -> int:
        return int(self.index["step"])

    @property
    def mesh(self) -> dict[str, int]:
        return dict(self.index["mesh"])

    def extra(self) -> dict[str, Any]:
        """Rank 0's small state (data position, losses): global, the same on every rank."""
        return dict(self.index["ranks"][0]["extra"])

    def whole(self, key: str) -> torch.Tensor:
        """The global tensor ``key`` without padding."""
        shape = self.global_shape(key)
        return self.read(key, tuple(0 for _ in shape), shape, self.dtype(key))

    def global_shape(self, key: str) -> tuple[int, ...]:
        piece = self.pieces[key][0]
        return piece.record.global_shape if piece.record is not None else piece.shape

    def dtype(self, key: str) -> torch.dtype:
        return self.pieces[key][0].dtype

    def params(self) -> dict[str, tuple[int, ...]]:
        """Global parameter name -> global shape."""
        return {key[len(MODEL) :]: self.global_shape(key) for key in self.pieces if key.startswith(MODEL)}

    def optim_state(self) -> dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        """Parameter name -> {state key: (dtype, global shape)} of the saved optimizer state."""
        out: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}
        for key in self.pieces:
            if key.startswith(OPTIM):
                name, _, state = key[len(OPTIM) :].rpartition("/")
                out.setdefault(name, {})[state] = (self.dtype(key), self.global_shape(key))
        return out

    def rng_piece(self, coords: Mapping[str, int]) -> Piece | None:
        """The saved generator a target rank at ``coords`` continues with: the source rank's at the
        same coordinates, each taken modulo the source axis size (None if no RNG was saved). A source
        whose dp was split (dp_replicate x dp_shard) reads a target's plain dp coordinate as the pair."""
        coords = dict(coords)
        for alias, (outer, inner) in self.layout.aliases.items():
            if alias in coords and outer not in coords:
                coords[outer], coords[inner] = divmod(coords[alias] % self.layout.size(alias), self.sizes[inner])
        rank = self.layout.rank_of({a: coords.get(a, 0) % n for a, n in self.sizes.items()})
        return next((p for p in self.pieces.get(RNG, []) if p.rank == rank), None)

    def resolve(self, key: str) -> str:
        """The saved key that holds ``key``'s values.

        ``optim/<name>/master`` falls back to the weights ``model/<name>`` when the source kept no
        masters (plain fp32 training steps the weights themselves, so they are the masters).
        """
        if key not in self.pieces and key.startswith(OPTIM) and key.endswith(f"/{MASTER}"):
            key = MODEL + key[len(OPTIM) : -len(MASTER) - 1]
        if key not in self.pieces:
            raise CheckpointError(f"{self.folder} holds no tensor {key!r}; was it saved from a different model?")
        return key

    def read(self, key: str, start: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The region ``start`` + ``shape`` of the global tensor ``key``, zero past its global shape (padding)."""
        key = self.resolve(key)
        out = torch.zeros(shape, dtype=dtype)
        full = self.global_shape(key)
        if len(full) != len(shape):
            raise CheckpointError(f"{key!r} has shape {list(full)} in {self.folder}, but {len(shape)} dims are asked")
        want = [(s, min(s + n, g)) for s, n, g in zip(start, shape, full)]
        needed = math.prod(max(0, hi - lo) for lo, hi in want)
        if needed == 0:  # all padding
            return out
        covered, seen = 0, set()
        for piece in self.pieces[key]:
            region = self._region(piece)
            if region in seen:  # a replica of a piece already read
                continue
            overlap = [(max(lo, a), min(hi, b)) for (lo, hi), (a, b) in zip(want, region)]
            if any(lo >= hi for lo, hi in overlap):
                continue
            seen.add(region)
            local = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, region))
            target = tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(overlap, start))
            out[target] = self.read_piece(piece, key, local).to(dtype)
            covered += math.prod(hi - lo for lo, hi in overlap)
            if covered >= needed:
                break
        if covered != needed:
            raise CheckpointError(f"{self.folder}: the saved pieces of {key!r} do not cover the region asked for")
        return out

    def read_blocks(
        self, key: str, start: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype, max_block_bytes: int
    ) -> Iterator[torch.Tensor]:
        """The region ``start`` + ``shape`` of ``key`` (as :meth:`read`) in row blocks of at most
        ``max_block_bytes`` (at least one row each), so a large tensor is never held whole."""
        if not shape:
            yield self.read(key, start, shape, dtype)
            return
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        rows = max(1, max_block_bytes // max(1, row_bytes))
        for first in range(0, shape[0], rows):
            n = min(rows, shape[0] - first)
            yield self.read(key, (start[0] + first, *start[1:]), (n, *shape[1:]), dtype)

    def _region(self, piece: Piece) -> tuple[tuple[int, int], ...]:
        """The piece's (start, end) per dim in global coordinates (its padded tail included)."""
        if piece.record is None:
            return tuple((0, n) for n in piece.shape)
        slices = piece.record.local_slices(self.sizes, self.layout.coords(piece.rank))
        return tuple((s.start, s.stop) for s in slices)

    def read_piece(self, piece: Piece, key: str, local: tuple[slice, ...] = ()) -> torch.Tensor:
        """The part ``local`` (default: all) of one saved piece."""
        # Opened per read: the file's mapped pages are released as soon as the slice is copied.
        with safe_open(str(self.folder / self.index["ranks"][piece.rank]["file"]), framework="pt") as f:
            expected = tuple(b - a for a, b in self._region(piece)) if piece.record else piece.shape
            if piece.shape == expected:
                tensor: torch.Tensor = f.get_slice(key)[local] if local else f.get_tensor(key)
                return tensor
            # A piece stored flat or as (1,) for a scalar: read it whole and view it as its region.
            whole: torch.Tensor = f.get_tensor(key)
            return whole.reshape(expected)[local]
