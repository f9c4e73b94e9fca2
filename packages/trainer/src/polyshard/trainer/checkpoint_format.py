"""The checkpoint format, in one place: folder and file names, tensor keys, dtype names, the
index, a verified reader and a streaming writer. Save, load, reshard, export and inspect all
go through it.

A checkpoint is a folder ``step_00000100/``::

    rank_00000.safetensors   one rank's local tensors
    rank_00001.safetensors
    index.json               {"format", "step", "mesh", "world_size", "config",
                              "ranks": [{"file", "sha256", "tensors": {key: record}, "extra"}],
                              "assets": {file: sha256} (files the run needs besides tensors),
                              "resharded_from" (when written by reshard)}
    tokenizer.json           an asset: the run's tokenizer, when it is not the byte tokenizer

Tensor keys are global and self-describing (:func:`model_key`, :func:`optim_key`)::

    model/layers.3.attn.q_proj.weight          this rank's piece (tp slice, ZeRO-3 rows ...)
    optim/layers.3.attn.q_proj.weight/master   ZeRO's fp32 master rows (when the optimizer keeps them)
    optim/layers.3.attn.q_proj.weight/exp_avg  AdamW state, shaped like the parameter or its rows
    rng/torch                                  this process's CPU generator

Each record is a :class:`polyshard.mesh.TensorPlacement` (None: the same whole tensor on every
holder). Nothing is pickled; a folder appears only when complete (:func:`publish`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import shutil
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from polyshard.mesh import MeshLayout, PlacementError, TensorPlacement
from polyshard.trainer.config import Config, from_dict

FORMAT_VERSION = 1

MODEL, OPTIM, RNG = "model/", "optim/", "rng/torch"
MASTER = "master"  # optimizer state kept besides the moments: ZeRO's (and bf16's) fp32 master copy
ASSETS = "assets"
TOKENIZER = "tokenizer.json"  # the run's tokenizer, saved with each checkpoint so the weights keep their meaning


def model_key(name: str) -> str:
    return f"{MODEL}{name}"


def optim_key(name: str, state: str) -> str:
    return f"{OPTIM}{name}/{state}"


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


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def publish(tmp: Path, final: Path, index: dict) -> None:
    """Write ``index.json`` into the finished temporary folder ``tmp`` and rename it to ``final``."""
    with open(tmp / "index.json", "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def read_index(folder: str | Path) -> dict:
    folder = Path(folder)
    index_path = folder / "index.json"
    if not index_path.is_file():
        raise CheckpointError(f"{index_path} is missing: {folder} is not a complete checkpoint")
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{index_path} is not valid JSON: {err}") from err
    if not isinstance(index, dict) or index.get("format") != FORMAT_VERSION:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(f"{index_path} has format {found}, expected {FORMAT_VERSION}")
    _check_index(folder, index_path, index)
    return index


def _check_index(folder: Path, index_path: Path, index: dict) -> None:
    """An index is untrusted input: its shape is checked before any file it names is opened. Rank
    files must be bare names of files inside ``folder`` (no path, no link out of it)."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{index_path}: {what}; the index is damaged or was not written by polyshard")

    mesh, ranks = index.get("mesh"), index.get("ranks")
    if not isinstance(index.get("step"), int) or isinstance(index.get("step"), bool) or index["step"] < 0:
        raise bad(f"'step' is {index.get('step')!r}, not a step number")
    if not isinstance(mesh, dict) or not all(isinstance(n, int) and n >= 1 for n in mesh.values()):
        raise bad(f"'mesh' is {mesh!r}, not axis sizes")
    if not isinstance(ranks, list) or index.get("world_size") != len(ranks) or len(ranks) != math.prod(mesh.values()):
        raise bad(f"'world_size' {index.get('world_size')!r}, the mesh {mesh} and the rank entries disagree")
    inside = folder.resolve()
    for rank, entry in enumerate(ranks):
        if not isinstance(entry, dict) or not {"file", "sha256", "tensors"} <= set(entry):
            raise bad(f"rank {rank}'s entry lacks 'file', 'sha256' or 'tensors'")
        name = entry["file"]
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise bad(f"rank {rank}'s file {name!r} is not a bare file name inside the checkpoint folder")
        if (folder / name).resolve().parent != inside:
            raise bad(f"rank {rank}'s file {name!r} leads outside {folder}")
        if not isinstance(entry["tensors"], dict) or not isinstance(entry.get("extra", {}), dict):
            raise bad(f"rank {rank}'s 'tensors' or 'extra' is not a table")
    assets = index.get(ASSETS, {})
    if not isinstance(assets, dict):
        raise bad(f"'{ASSETS}' is {assets!r}, not a table of file names and sha256 digests")
    rank_files = {entry["file"] for entry in ranks} | {"index.json"}
    for name, digest in assets.items():
        if Path(name).name != name or name in ("", ".", "..") or name in rank_files or not isinstance(digest, str):
            raise bad(f"the asset {name!r} is not a bare file name with a sha256 digest")
        if (folder / name).resolve().parent != inside:
            raise bad(f"the asset {name!r} leads outside {folder}")


def verify_files(folder: str | Path, index: dict, ranks: list[int] | None = None) -> None:
    """Check the sha256 of each rank file (all when ``ranks`` is None) before any tensor is used."""
    folder = Path(folder)
    for rank in ranks if ranks is not None else range(index["world_size"]):
        entry = index["ranks"][rank]
        path = folder / entry["file"]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the checkpoint")
        if sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{path} does not match its sha256 in index.json: truncated or modified")
    if ranks is None:
        for name, digest in index.get(ASSETS, {}).items():
            path = folder / name
            if not path.is_file() or sha256(path) != digest:
                raise CheckpointError(f"{path} is missing or does not match its sha256 in index.json")


def rank_entry(file: str, digest: str, records: Mapping[str, TensorPlacement | None], extra: Mapping) -> dict:
    """One rank's entry of the index."""
    return {
        "file": file,
        "sha256": digest,
        "tensors": {key: (record.to_json() if record is not None else None) for key, record in records.items()},
        "extra": dict(extra),
    }


def make_index(step: int, mesh: Mapping[str, int], entries: list[dict], config: Mapping | None = None, **more) -> dict:
    """The whole index of a checkpoint; ``more`` adds fields such as ``resharded_from``."""
    index = {"format": FORMAT_VERSION, "step": step, "mesh": dict(mesh), "world_size": len(entries), "ranks": entries}
    if config is not None:
        index["config"] = dict(config)
    return {**index, **more}


def copy_assets(files: Mapping[str, Path], folder: Path) -> dict[str, str]:
    """Copy ``files`` (asset name -> where it is now) into the checkpoint being written in ``folder``;
    returns the index's ``assets`` table (name -> sha256 of the copy)."""
    table = {}
    for name, path in sorted(files.items()):
        shutil.copyfile(path, folder / name)
        table[name] = sha256(folder / name)
    return table


@dataclass(frozen=True)
class Piece:
    """One rank's saved piece of a global tensor: which file holds it and which region it covers."""

    rank: int
    record: TensorPlacement | None
    shape: tuple[int, ...]  # as stored
    dtype: torch.dtype


@contextlib.contextmanager
def _opened(path: Path):
    """A safetensors file opened for lazy reads; a damaged one is a CheckpointError naming it."""
    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from err
    with handle as f:
        yield f


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
                        Piece(rank, placement, tuple(stored.get_shape()), _DTYPES[stored.get_dtype()])
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


class StreamWriter:
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
