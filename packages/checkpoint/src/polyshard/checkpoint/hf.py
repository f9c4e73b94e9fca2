"""Hugging Face model folders: read one as a checkpoint source, write one tensor at a time.

A folder is ``config.json`` plus ``model.safetensors``, or shards named by
``model.safetensors.index.json`` (as ``save_pretrained`` writes them). This module knows no model
family: the caller says where each of its tensors lives (:class:`TensorLocation`) and what
``config.json`` holds. The trainer's model families (``polyshard.models.<family>.hf``) do.
Every file is untrusted input (:mod:`polyshard.checkpoint.untrusted`): JSON is read bounded, the index may
name only bare files inside the folder, and no file may lead out of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from polyshard.checkpoint import mxfp4
from polyshard.checkpoint.format import MASTER, MODEL, OPTIM, CheckpointError
from polyshard.checkpoint.output import check_destination, new_folder
from polyshard.checkpoint.source import Piece
from polyshard.checkpoint.untrusted import check_inside, read_json
from polyshard.checkpoint.writer import StreamWriter

PREFIX = "hf:"  # --init-from hf:DIR
CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes a weight may have


@dataclass(frozen=True)
class TensorLocation:
    """Where one of our tensors lives in a Hugging Face file: its name; whether it is stored transposed
    (GPT-2's ``Conv1D`` keeps ``x @ W``'s W, a ``Linear`` weight transposed); and, when ``parts``
    of our tensors sit side by side along the stored tensor's last dim (GPT-2's fused q, k, v in
    ``c_attn``), the offset of this one there."""

    name: str
    transposed: bool = False
    offset: int = 0
    parts: int = 1
    rows: int | None = None
    """Only the first ``rows`` rows of the stored tensor are ours (GPT-2's position table, cropped
    to a shorter context); None: all of them."""
    stacked: tuple[str, ...] = ()
    """Our tensor is these stored tensors stacked along a new dim 0, each read as ``name`` alone would
    be (transposed when ``transposed``): one per expert, as Mixtral's ``experts.<e>.w1.weight`` make our
    ``(E, H, F)`` experts. ``name`` is then the first of them. A rank holding experts [a, b) reads
    only their files' tensors."""
    mxfp4: bool = False
    """Stored in MXFP4 as ``<name>_blocks`` and ``<name>_scales`` (gpt-oss's released experts), our tensor
    their dequantized values with the last two dims transposed (:mod:`polyshard.checkpoint.mxfp4`).
    :class:`HFWeights` sets it when a folder holds those instead of ``name``."""

    @property
    def names(self) -> tuple[str, ...]:
        """Every stored tensor this one is read from."""
        if self.mxfp4:
            return (f"{self.name}_blocks", f"{self.name}_scales")
        return self.stacked or (self.name,)


def read_config(folder: Path) -> tuple[dict[str, Any], Path]:
    """A folder's parsed ``config.json`` (a JSON object) and its path."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder} holds no {CONFIG_FILE}; give a Hugging Face model folder")
    config = read_json(folder, path)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config, path


def weight_files(folder: Path) -> dict[str, str]:
    """HF tensor name -> the file (a bare name inside ``folder``) that holds it."""
    index = folder / INDEX_FILE
    if index.is_file():
        raw = read_json(folder, index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: not a safetensors index (its weight_map must map tensor names to files)")
        for file in set(weight_map.values()):
            if not isinstance(file, str) or Path(file).name != file or not (folder / file).is_file():
                raise CheckpointError(f"{index} names {file!r}; each file must be a bare name of a file in {folder}")
            check_inside(folder, folder / file)
        return {str(name): file for name, file in weight_map.items()}
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        raise CheckpointError(f"{folder} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    check_inside(folder, single)
    with _opened(single) as f:
        return {name: WEIGHTS_FILE for name in f.keys()}


def _opened(path: Path) -> Any:
    try:
        return safe_open(str(path), "pt")
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from err


class HFWeights:
    """The weights of a Hugging Face folder, opened as a checkpoint source (no optimizer state, no
    RNG: a run initialised from it starts at step 0).

    ``locations``: our parameter name -> where it lives. ``canonical`` maps a stored name to the
    name ``locations`` uses (a base model's file omits the causal LM's prefix). Stored names ending
    in one of ``buffers`` hold no weights and are ignored; any other name nobody asked for, or a
    missing one, is an error naming them.
    """

    def __init__(
        self,
        folder: str | Path,
        locations: Mapping[str, TensorLocation],
        *,
        title: str = "model",
        canonical: Callable[[str], str] = lambda name: name,
        buffers: tuple[str, ...] = (),
    ):
        self.folder = Path(folder)
        stored = weight_files(self.folder)
        self.stored = {canonical(name): name for name in stored}
        self.files = {canonical(name): file for name, file in stored.items()}
        self.locations = {ours: _quantized(where, self.files) for ours, where in locations.items()}
        packed = {name for where in self.locations.values() if where.mxfp4 for name in where.names}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, file in self.files.items():
            with _opened(self.folder / file) as f:
                if self.stored[name] not in f.keys():
                    raise CheckpointError(
                        f"{self.folder / file} holds no tensor {self.stored[name]!r}, which the index lists"
                    )
                stored = f.get_slice(self.stored[name])
                self.shapes[name] = tuple(stored.get_shape())
                dtype = stored.get_dtype()
                if name in packed:  # checked with its other part below
                    continue
                if dtype not in FLOAT_DTYPES and not name.endswith(buffers):
                    raise CheckpointError(
                        f"{self.folder / file}: {self.stored[name]!r} is stored as {dtype}; a weight must be "
                        f"floating point ({', '.join(FLOAT_DTYPES)}): the file is damaged or not a model's weights"
                    )
        needed = {name for location in self.locations.values() for name in location.names}
        missing = sorted(needed - set(self.shapes))
        unexpected = sorted(n for n in set(self.shapes) - needed if not n.endswith(buffers))
        if missing or unexpected:
            raise CheckpointError(
                f"{self.folder} is not the {title} these settings describe: missing {missing}, unexpected {unexpected}"
            )
        for ours, location in self.locations.items():
            if location.mxfp4:
                self._check_packed(location)
                continue
            held = self.shapes[location.name]
            for other in location.stacked:  # one shape for every expert
                if self.shapes[other] != held:
                    raise CheckpointError(
                        f"{self.folder}: {other!r} is {list(self.shapes[other])}, but {location.name!r} is "
                        f"{list(held)}; every expert's tensor in {ours} must have one shape"
                    )
            if location.rows is not None and (not held or location.rows > held[0]):
                raise CheckpointError(
                    f"{self.folder}: {location.name!r} is {list(held)}, "
                    f"fewer rows than the {location.rows} {ours} needs"
                )

    def _check_packed(self, location: TensorLocation) -> None:
        blocks, scales = (self.shapes[name] for name in location.names)
        if len(blocks) < 3 or blocks[-1] != mxfp4.BLOCK // 2 or blocks[:-1] != scales:
            raise CheckpointError(
                f"{self.folder}: {location.name}_blocks {list(blocks)} and _scales {list(scales)} are not MXFP4 "
                f"(blocks (..., rows, groups, {mxfp4.BLOCK // 2}) bytes, scales (..., rows, groups))"
            )
        files = [self.folder / self.files[name] for name in location.names]
        dtypes = []
        for name, path in zip(location.names, files, strict=True):
            with _opened(path) as f:
                dtypes.append(f.get_slice(self.stored[name]).get_dtype())
        try:
            mxfp4.check_header(*dtypes)
        except ValueError as err:
            raise CheckpointError(f"{files[0]}: {location.name}: {err}") from err
        with _opened(files[1]) as f:  # the scales, one slice of the leading dim at a time: 1/16 of the bytes
            stored = f.get_slice(self.stored[location.names[1]])
            nan = sum(mxfp4.nan_scales(stored[i : i + 1]) for i in range(scales[0]))
        if nan:
            raise CheckpointError(
                f"{files[1]}: {self.stored[location.names[1]]!r} holds {nan} scale byte(s) of {mxfp4.NAN_SCALE}, "
                "MXFP4's NaN code; the folder's weights are damaged (re-save or re-download them)"
            )

    def resolve(self, key: str) -> str:
        """Model keys as they are; an fp32 master is read from the weights it starts as."""
        if key.startswith(OPTIM) and key.endswith(f"/{MASTER}"):
            key = MODEL + key[len(OPTIM) : -len(MASTER) - 1]
        if not key.startswith(MODEL) or key[len(MODEL) :] not in self.locations:
            raise CheckpointError(f"{self.folder} holds no tensor for {key!r}")
        return key

    def global_shape(self, key: str) -> tuple[int, ...]:
        location = self.locations[self.resolve(key)[len(MODEL) :]]
        if location.mxfp4:  # (..., rows, groups, 16) bytes -> (..., groups * 32, rows) values
            *lead, rows, groups, _ = self.shapes[location.names[0]]
            return (*lead, groups * mxfp4.BLOCK, rows)
        saved = self.shapes[location.name]
        if location.stacked:  # (experts, one stored tensor's shape, transposed if stored so)
            return (len(location.stacked), *(saved[::-1] if location.transposed else saved))
        if location.transposed:  # our (out, in) is HF's (in, out); a fused tensor's out holds several of ours
            return (saved[-1] // location.parts, saved[0])
        if location.parts > 1:
            return (saved[0] // location.parts, *saved[1:])
        if location.rows is not None:
            return (location.rows, *saved[1:])
        return saved

    def read(self, key: str, start: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The region ``start`` + ``shape`` of our tensor ``key``, zero past its shape (padding)."""
        key = self.resolve(key)
        location, full = self.locations[key[len(MODEL) :]], self.global_shape(key)
        out = torch.zeros(shape, dtype=dtype)
        want = [(s, min(s + n, g)) for s, n, g in zip(start, shape, full)]
        if any(hi <= lo for lo, hi in want):
            return out  # all padding
        if location.stacked:  # only the experts in this region: one stored tensor each
            (e0, e1), rest = want[0], want[1:]
            block = torch.stack([self._region(location, location.stacked[e], rest) for e in range(e0, e1)])
        else:
            block = self._region(location, location.name, want)
        out[tuple(slice(0, hi - lo) for lo, hi in want)] = block.to(dtype)
        return out

    def _region(self, location: TensorLocation, name: str, want: list[tuple[int, int]]) -> torch.Tensor:
        """The region ``want`` ((low, high) per dim, in our layout) of stored tensor ``name``, checked finite."""
        block: torch.Tensor  # safetensors' slices are untyped
        if location.mxfp4:
            return self._dequantized(location, want)
        with _opened(self.folder / self.files[name]) as f:
            stored = f.get_slice(self.stored[name])
            if location.transposed:
                (r0, r1), (c0, c1) = want
                block = stored[c0:c1, location.offset + r0 : location.offset + r1].T
            elif len(want) == 1:
                ((lo, hi),) = want
                block = stored[location.offset + lo : location.offset + hi]
            else:
                block = stored[tuple(slice(lo, hi) for lo, hi in want)]
        if not bool(torch.isfinite(block).all()):  # read anyway: only this rank's region is checked
            raise CheckpointError(
                f"{self.folder / self.files[name]}: {self.stored[name]!r} holds NaN or infinite "
                "values; the folder's weights are damaged (re-save or re-download them)"
            )
        return block

    def _dequantized(self, location: TensorLocation, want: list[tuple[int, int]]) -> torch.Tensor:
        """The region ``want`` of an MXFP4 tensor: only its rows' blocks and scales are read (an ep rank's
        experts), dequantized, then cut along the packed dim."""
        *lead, (c0, c1), (r0, r1) = want  # ours (..., cols, rows): the stored rows are our last dim
        index = (*(slice(lo, hi) for lo, hi in lead), slice(r0, r1))
        parts = []
        for name in location.names:
            with _opened(self.folder / self.files[name]) as f:
                parts.append(f.get_slice(self.stored[name])[index])
        try:
            values = mxfp4.dequantize(parts[0], parts[1])
        except ValueError as err:
            files = " and ".join(sorted({str(self.folder / self.files[name]) for name in location.names}))
            raise CheckpointError(f"{files}: {location.name}_blocks with its _scales {err}") from err
        return values[..., c0:c1, :]

    def optim_state(self) -> dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        return {}

    def rng_piece(self, coords: Mapping[str, int]) -> Piece | None:
        return None

    def read_piece(self, piece: Piece, key: str, local: tuple[slice, ...] = ()) -> torch.Tensor:
        raise CheckpointError(f"{self.folder} is a Hugging Face folder: it holds no per-rank pieces")


def _quantized(location: TensorLocation, files: Mapping[str, str]) -> TensorLocation:
    """``location``, marked MXFP4 when the folder holds ``<name>_blocks`` and ``<name>_scales`` instead."""
    packed = f"{location.name}_blocks" in files and f"{location.name}_scales" in files
    if location.name in files or not packed or location.stacked or location.transposed or location.parts > 1:
        return location
    return dataclasses.replace(location, mxfp4=True)


def check_new_folder(destination: str | Path, *, overwrite: bool = False, protected: Iterable[Path] = ()) -> Path:
    """``destination`` as a folder to create: new (or, with ``overwrite``, a folder to replace), in a folder
    that exists, and outside everything ``protected`` (:func:`polyshard.checkpoint.output.check_destination`)."""
    return check_destination(destination, folder=True, overwrite=overwrite, protected=protected)


def write_hf_folder(
    destination: str | Path,
    config: Mapping[str, object],
    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor | Iterable[torch.Tensor]],
    *,
    max_shard_bytes: int = 5 << 30,
    files: Mapping[str, Path | str] | None = None,
    overwrite: bool = False,
    protected: Iterable[Path] = (),
) -> Path:
    """Write a Hugging Face folder into ``destination``, which must not exist yet (``overwrite``: or is a
    folder to replace; never one of ``protected``, the folders being read).

    ``tensors`` is every HF tensor's (dtype, shape) in file order; ``produce(name)`` returns one, or
    its row blocks in order (called once each, so only one tensor or block is held at a time). Up to
    ``max_shard_bytes`` they go into ``model.safetensors``, above it into
    ``model-00001-of-0000N.safetensors`` shards with ``model.safetensors.index.json``. ``files``
    (name -> a file to copy, or text) lands beside ``config.json``. The folder is built under a
    temporary name of ours and renamed, so it is whole or absent.
    """
    destination = check_new_folder(destination, overwrite=overwrite, protected=protected)
    with new_folder(destination, overwrite=overwrite) as tmp:
        for name, content in (files or {}).items():
            if isinstance(content, Path):
                shutil.copyfile(content, tmp / name)
            else:
                (tmp / name).write_text(content)
        (tmp / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
        shards = _shards(tensors, max_shard_bytes)
        weight_map = {}
        for i, names in enumerate(shards, start=1):
            shard = WEIGHTS_FILE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            writer = StreamWriter(tmp / shard, {n: tensors[n] for n in names}, metadata={"format": "pt"})
            try:
                for name in names:
                    made = produce(name)
                    for block in [made] if isinstance(made, torch.Tensor) else made:
                        writer.write(name, block.to(tensors[name][0]))
                writer.close()
            except BaseException:
                writer.abort()
                raise
            weight_map.update(dict.fromkeys(names, shard))
        if len(shards) > 1:
            total = sum(_nbytes(*spec) for spec in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return destination


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _shards(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], max_bytes: int) -> list[list[str]]:
    """Tensor names in file order, cut into groups of at most ``max_bytes`` (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, spec in tensors.items():
        nbytes = _nbytes(*spec)
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups
