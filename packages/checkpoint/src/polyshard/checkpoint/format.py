"""The checkpoint format, in one place: folder and file names, tensor keys, dtype names and the index.

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
holder). ``config`` is the training run's settings as written by the trainer; this package stores
it and hands it back (:attr:`polyshard.checkpoint.Checkpoint.settings`) without reading it.
Nothing is pickled; a folder appears only when complete (:func:`publish`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from polyshard.checkpoint.errors import CheckpointError as CheckpointError  # re-exported: the format's error
from polyshard.checkpoint.output import publish_folder
from polyshard.checkpoint.untrusted import check_inside, read_json
from polyshard.mesh import TensorPlacement

FORMAT_VERSION = 1

MODEL, OPTIM, RNG = "model/", "optim/", "rng/torch"
MASTER = "master"  # optimizer state kept besides the moments: ZeRO's (and bf16's) fp32 master copy
ASSETS = "assets"
TOKENIZER = "tokenizer.json"  # the run's tokenizer, saved with each checkpoint so the weights keep their meaning
INDEX_LIMIT = 1 << 30  # an index lists every tensor of every rank: about 1 MB a rank for the largest models


def model_key(name: str) -> str:
    return f"{MODEL}{name}"


def optim_key(name: str, state: str) -> str:
    return f"{OPTIM}{name}/{state}"


# safetensors' dtype names (https://github.com/huggingface/safetensors, format description)
DTYPE_NAMES = {
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
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


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


def write_index(folder: Path, index: dict[str, Any]) -> None:
    """``index.json`` into a finished checkpoint folder (still under its temporary name), synced to disk."""
    with open(folder / "index.json", "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def publish(tmp: Path, final: Path, index: dict[str, Any], *, overwrite: bool = True) -> None:
    """Write ``index.json`` into the finished temporary folder ``tmp`` and put it in place as ``final``
    (:func:`polyshard.checkpoint.output.publish_folder`: a save of a step already saved replaces it)."""
    write_index(tmp, index)
    publish_folder(tmp, final, overwrite=overwrite)


def read_index(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    index_path = folder / "index.json"
    if not index_path.is_file():
        raise CheckpointError(f"{index_path} is missing: {folder} is not a complete checkpoint")
    index = read_json(folder, index_path, limit=INDEX_LIMIT)
    if not isinstance(index, dict) or index.get("format") != FORMAT_VERSION:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(f"{index_path} has format {found}, expected {FORMAT_VERSION}")
    _check_index(folder, index_path, index)
    return index


def _check_index(folder: Path, index_path: Path, index: dict[str, Any]) -> None:
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
    for rank, entry in enumerate(ranks):
        if not isinstance(entry, dict) or not {"file", "sha256", "tensors"} <= set(entry):
            raise bad(f"rank {rank}'s entry lacks 'file', 'sha256' or 'tensors'")
        name = entry["file"]
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise bad(f"rank {rank}'s file {name!r} is not a bare file name inside the checkpoint folder")
        check_inside(folder, folder / name)
        if not isinstance(entry["tensors"], dict) or not isinstance(entry.get("extra", {}), dict):
            raise bad(f"rank {rank}'s 'tensors' or 'extra' is not a table")
    assets = index.get(ASSETS, {})
    if not isinstance(assets, dict):
        raise bad(f"'{ASSETS}' is {assets!r}, not a table of file names and sha256 digests")
    rank_files = {entry["file"] for entry in ranks} | {"index.json"}
    for name, digest in assets.items():
        if Path(name).name != name or name in ("", ".", "..") or name in rank_files or not isinstance(digest, str):
            raise bad(f"the asset {name!r} is not a bare file name with a sha256 digest")
        check_inside(folder, folder / name)


def verify_files(folder: str | Path, index: dict[str, Any], ranks: list[int] | None = None) -> None:
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


def rank_entry(
    file: str, digest: str, records: Mapping[str, TensorPlacement | None], extra: Mapping[str, Any]
) -> dict[str, Any]:
    """One rank's entry of the index."""
    return {
        "file": file,
        "sha256": digest,
        "tensors": {key: (record.to_json() if record is not None else None) for key, record in records.items()},
        "extra": dict(extra),
    }


def make_index(
    step: int,
    mesh: Mapping[str, int],
    entries: list[dict[str, Any]],
    config: Mapping[str, Any] | None = None,
    **more: Any,
) -> dict[str, Any]:
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
