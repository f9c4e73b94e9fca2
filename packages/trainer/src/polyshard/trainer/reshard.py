"""Move a checkpoint to another mesh: offline (:func:`reshard`) or while loading (:func:`load_into`).

Both read a source checkpoint the same way. Every saved piece carries a
placement record, so each piece's region of the global tensor is known
(:meth:`Source.read`). A target piece is a region of the global tensor too.
It is filled from the source pieces that overlap it, read with safetensors'
lazy slicing, with zeros in any padding rows. Replicated copies are read
once. Every source file's sha256 is checked first, so no tensor is used from
a corrupt checkpoint.

Offline, the target layout comes from :mod:`polyshard.trainer.records` (names,
shapes and the target config; no model and no processes). Online, each rank
asks for the records its live engine holds. What moves:

* weights, AdamW moments and step, ZeRO's fp32 masters (regrouped for any dp
  size; made from the weights when the source kept none, dropped when the
  target needs none);
* the data position: it counts examples of the global, layout-independent
  sample order (see :mod:`polyshard.trainer.data.loader`), so it holds for
  any number of data ranks;
* the recorded losses;
* RNG: target rank r takes the generator of the source rank at the same
  coordinates (each coordinate taken modulo the source axis size). Nothing
  else in a step draws from it unless dropout is on.

Memory: offline, one target tensor is written in blocks of at most
``max_block_bytes`` rows. Each block is filled from reads of the same size, and
source files are opened per read, so their mapped pages are released. Peak
tensor data is therefore about twice the block, whatever the size of the
checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import shutil
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from polyshard.mesh import MeshLayout, TensorPlacement, get_placement
from polyshard.trainer.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    publish,
    rank_file,
    read_index,
    step_dir,
    verify_files,
)
from polyshard.trainer.config import Config, from_dict
from polyshard.trainer.constraints import validate
from polyshard.trainer.parallelize import Engine
from polyshard.trainer.records import MASTER, Planned, plan_ranks
from polyshard.trainer.state import load_state_tensors, optimizer_entries, state_tensors

MODEL, OPTIM, RNG = "model/", "optim/", "rng/torch"
DEFAULT_BLOCK_BYTES = 64 << 20

# safetensors' dtype names (https://github.com/huggingface/safetensors, format description)
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class Piece:
    """One rank's saved piece of a global tensor: which file holds it and which region it covers."""

    rank: int
    record: TensorPlacement | None
    shape: tuple[int, ...]  # as stored
    dtype: torch.dtype


class Source:
    """A verified checkpoint, opened to read any region of any of its global tensors."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.index = read_index(self.folder)
        verify_files(self.folder, self.index)
        self.layout = MeshLayout(self.index["mesh"])
        self.sizes = self.layout.as_dict()
        self.pieces: dict[str, list[Piece]] = {}
        for rank, entry in enumerate(self.index["ranks"]):
            with safe_open(str(self.folder / entry["file"]), framework="pt") as f:
                for key, record in entry["tensors"].items():
                    stored = f.get_slice(key)
                    self.pieces.setdefault(key, []).append(
                        Piece(
                            rank,
                            TensorPlacement.from_json(record) if record is not None else None,
                            tuple(stored.get_shape()),
                            _DTYPES[stored.get_dtype()],
                        )
                    )

    @functools.cached_property
    def config(self) -> Config:
        """The settings of the run that saved the checkpoint."""
        if "config" not in self.index:
            raise CheckpointError(f"{self.folder}/index.json records no config; it cannot be laid out on another mesh")
        return from_dict(self.index["config"])

    def whole(self, key: str) -> torch.Tensor:
        """The global tensor ``key`` without padding."""
        shape = self.global_shape(key)
        return self.read(key, tuple(0 for _ in shape), shape, self.dtype(key))

    @property
    def step(self) -> int:
        return self.index["step"]

    def extra(self) -> dict:
        """Rank 0's small state (data position, losses): global, the same on every rank."""
        return self.index["ranks"][0]["extra"]

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
        out: dict[str, dict] = {}
        for key in self.pieces:
            if key.startswith(OPTIM):
                name, _, state = key[len(OPTIM) :].rpartition("/")
                out.setdefault(name, {})[state] = (self.dtype(key), self.global_shape(key))
        return out

    def rng_piece(self, coords: Mapping[str, int]) -> Piece | None:
        """The saved generator a target rank at ``coords`` continues with: the source rank's at the
        same coordinates, each taken modulo the source axis size (None if no RNG was saved)."""
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
                return f.get_slice(key)[local] if local else f.get_tensor(key)
            # A piece stored flat or as (1,) for a scalar: read it whole and view it as its region.
            return f.get_tensor(key).reshape(expected)[local]


def read_planned(source: Source, key: str, plan: Planned, sizes: Mapping[str, int], coords: Mapping[str, int]):
    """The whole local tensor ``plan`` describes for the rank at ``coords``."""
    return source.read(key, *_target_region(source, key, plan, sizes, coords), plan.dtype)


def _target_region(source, key, plan, sizes, coords) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if plan.record is None:
        return tuple(0 for _ in plan.shape), plan.shape
    saved = source.global_shape(source.resolve(key))
    if tuple(saved) != plan.record.global_shape:
        raise CheckpointError(
            f"{key!r} is {list(saved)} in {source.folder} but {list(plan.record.global_shape)} in this model; "
            "the model settings must match the checkpoint's"
        )
    slices = plan.record.local_slices(sizes, coords)
    return tuple(s.start for s in slices), tuple(s.stop - s.start for s in slices)


# -- offline -------------------------------------------------------------------------------------------


def target_config(source: Source, mesh: Mapping[str, int], overrides: Mapping[str, object] | None = None) -> Config:
    """The source's config with the mesh (axes not named become 1) and other ``parallel`` fields replaced."""
    raw = dataclasses.asdict(source.config)
    raw["parallel"].update({axis: int(mesh.get(axis, 1)) for axis in ("dp", "tp", "pp", "ep")})
    raw["parallel"].update(overrides or {})
    return from_dict(raw)


@dataclass(frozen=True)
class ReshardReport:
    folder: Path
    step: int
    source_mesh: dict[str, int]
    target_mesh: dict[str, int]
    files: int
    tensor_bytes: int
    largest_block_bytes: int
    seconds: float

    def __str__(self) -> str:
        lines = [
            f"resharded step {self.step} from mesh {self.source_mesh} to {self.target_mesh}: "
            f"{self.files} rank files, {self.tensor_bytes / 2**20:.1f} MiB of tensors, largest block "
            f"{self.largest_block_bytes / 2**20:.2f} MiB, {self.seconds:.1f} s -> {self.folder}",
            "moved with the weights: optimizer state, data position (global: valid for any number of data "
            "ranks), losses",
        ]
        if self.source_mesh != self.target_mesh:
            lines.append(
                "RNG: each rank continues the generator of the source rank at its coordinates modulo the "
                "source mesh (only dropout draws from it)"
            )
        return "\n".join(lines)


def reshard(
    src: str | Path, dst_root: str | Path, config: Config, *, max_block_bytes: int = DEFAULT_BLOCK_BYTES
) -> ReshardReport:
    """Write the checkpoint ``src`` for ``config``'s mesh as ``dst_root/step_N``, without processes.

    The result is what a run on the new layout would have saved: its
    ``--resume`` continues from it. The folder appears only when complete.
    """
    started = time.perf_counter()
    validate(config)
    source = Source(src)
    if dataclasses.asdict(config.model) != dataclasses.asdict(source.config.model):
        raise CheckpointError("resharding changes only the layout; the target config's model must equal the source's")
    final = step_dir(Path(dst_root), source.step)
    if final.exists():
        raise CheckpointError(f"{final} already exists; choose another destination or remove it")
    tmp = final.parent / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    layout = MeshLayout(config.parallel.mesh_axes)
    sizes = layout.as_dict()
    plans = plan_ranks(config, source.params(), source.optim_state())
    entries, total, largest = [], 0, 0
    try:
        for rank, plan in enumerate(plans):
            coords = layout.coords(rank)
            rng = source.rng_piece(coords)
            if rng is not None:
                plan = {**plan, RNG: Planned(None, rng.shape, rng.dtype)}
            writer = _StreamWriter(tmp / rank_file(rank), {k: (p.dtype, p.shape) for k, p in plan.items()})
            for key, item in plan.items():
                if key == RNG:
                    writer.write(key, source.read_piece(rng, RNG))
                    continue
                for block in _blocks(source, key, item, sizes, coords, max_block_bytes):
                    largest = max(largest, block.numel() * block.element_size())
                    writer.write(key, block)
            digest = writer.close()
            total += writer.data_bytes
            entries.append(
                {
                    "file": rank_file(rank),
                    "sha256": digest,
                    "tensors": {k: (p.record.to_json() if p.record else None) for k, p in plan.items()},
                    "extra": source.extra(),
                }
            )
        index = {
            "format": FORMAT_VERSION,
            "step": source.step,
            "mesh": dict(config.parallel.mesh_axes),
            "world_size": layout.world_size,
            "ranks": entries,
            "config": dataclasses.asdict(config),
            "resharded_from": {"folder": str(source.folder), "mesh": source.index["mesh"]},
        }
        publish(tmp, final, index)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written checkpoint behind
        raise
    return ReshardReport(
        final,
        source.step,
        source.index["mesh"],
        index["mesh"],
        len(entries),
        total,
        largest,
        time.perf_counter() - started,
    )


def _blocks(source, key, plan, sizes, coords, max_block_bytes) -> Iterator[torch.Tensor]:
    """The target tensor in row blocks of at most ``max_block_bytes`` (at least one row each)."""
    start, shape = _target_region(source, key, plan, sizes, coords)
    if not shape:
        yield source.read(key, start, shape, plan.dtype)
        return
    row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=plan.dtype).element_size()
    rows = max(1, max_block_bytes // max(1, row_bytes))
    for first in range(0, shape[0], rows):
        n = min(rows, shape[0] - first)
        yield source.read(key, (start[0] + first, *start[1:]), (n, *shape[1:]), plan.dtype)


class _StreamWriter:
    """Writes one safetensors file tensor by tensor, block by block, hashing as it goes.

    The format is an 8-byte little-endian header length, a JSON header naming
    each tensor's dtype, shape and byte range, then the raw bytes in that order.
    Since every shape is known up front the header is written first and the
    data follows, never held whole.
    """

    def __init__(self, path: Path, specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]):
        header, offset = {}, 0
        self.order = list(specs)
        self.sizes = {}
        for key in self.order:
            dtype, shape = specs[key]
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.sizes[key] = size
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.data_bytes = offset
        self.digest = hashlib.sha256()
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._put(struct.pack("<Q", len(text)) + text)
        self.position, self.current, self.written = 0, None, 0

    def _put(self, data: bytes) -> None:
        self.file.write(data)
        self.digest.update(data)

    def write(self, key: str, block: torch.Tensor) -> None:
        if key != self.current:
            if self.current is not None and self.written != self.sizes[self.current]:
                raise CheckpointError(f"internal: {self.current!r} written incompletely")
            if self.order[self.position] != key:
                raise CheckpointError(f"internal: {key!r} written out of order")
            self.position += 1
            self.current, self.written = key, 0
        data = block.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        self.written += len(data)
        self._put(data)

    def close(self) -> str:
        self.file.flush()
        self.file.close()
        return self.digest.hexdigest()


# -- online --------------------------------------------------------------------------------------------


def load_into(engine: Engine, source: Source) -> None:
    """Fill a freshly built ``engine`` (any mesh) from ``source`` (any mesh): weights, optimizer state, RNG."""
    layout = engine.mesh.layout
    sizes, coords = layout.as_dict(), layout.coords(engine.mesh.rank)
    tensors = {}
    for key, local in state_tensors(engine).items():
        if key != RNG:
            plan = Planned(local.placement, tuple(local.tensor.shape), local.tensor.dtype)
            tensors[key] = read_planned(source, key, plan, sizes, coords)
    saved = source.optim_state()
    for name, stepped, _, _ in optimizer_entries(engine):
        for state, (dtype, shape) in saved.get(name, {}).items():
            key = f"{OPTIM}{name}/{state}"
            if state == MASTER or key in tensors:
                continue
            if shape:  # moments: laid out like the tensor the optimizer steps
                plan = Planned(get_placement(stepped), tuple(stepped.shape), dtype)
            else:
                plan = Planned(None, (), dtype)
            tensors[key] = read_planned(source, key, plan, sizes, coords)
    rng = source.rng_piece(coords)
    if rng is not None:
        tensors[RNG] = source.read_piece(rng, RNG)
    load_state_tensors(engine, tensors)
