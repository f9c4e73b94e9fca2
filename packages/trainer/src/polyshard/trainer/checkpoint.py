"""Sharded checkpoints: one safetensors file per rank plus a JSON index.

Layout of ``<dir>/step_00000100/``::

    rank_00000.safetensors   this rank's local tensors (model, optimizer state, RNG)
    rank_00001.safetensors
    index.json               mesh, step, per-tensor placement records, a sha256 per file, extra state

Every rank writes its file into ``.tmp-step_00000100``; once all are written
rank 0 writes the index and renames the folder into place, so a reader never
sees a half-written checkpoint. Nothing is pickled. The placement records
(global name, global shape, Replicate/Shard per mesh axis) are what offline
resharding reads; it never needs the model or a process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from polyshard.mesh import TensorPlacement

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file."""


@dataclass(frozen=True)
class LocalTensor:
    """One tensor a rank saves, with its placement record (None: identical on every rank)."""

    tensor: torch.Tensor
    placement: TensorPlacement | None = None


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


def save_checkpoint(
    root: str | Path,
    step: int,
    tensors: Mapping[str, LocalTensor],
    *,
    mesh_axes: Mapping[str, int],
    extra: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Collectively save this rank's ``tensors``; returns the finished folder.

    ``extra`` (JSON-serialisable, gathered from every rank) lands in the index
    under ``"ranks"``; use it for data positions and other small state.
    ``config`` (the run's settings as a dict) lets offline tools lay the
    checkpoint out for another mesh.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = step_dir(Path(root), step)
    tmp = final.parent / f".tmp-{final.name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    path = tmp / rank_file(rank)
    # clone(): safetensors refuses tensors that share memory (ZeRO-3's fp32 masters are its shards).
    save_file({name: t.tensor.detach().cpu().clone().contiguous() for name, t in tensors.items()}, str(path))
    entry = {
        "file": path.name,
        "sha256": sha256(path),
        "tensors": {name: (t.placement.to_json() if t.placement is not None else None) for name, t in tensors.items()},
        "extra": dict(extra or {}),
    }
    entries = _gather(entry)
    if rank == 0:
        index = {
            "format": FORMAT_VERSION,
            "step": step,
            "mesh": dict(mesh_axes),
            "world_size": len(entries),
            "ranks": entries,
        }
        if config is not None:
            index["config"] = dict(config)
        publish(tmp, final, index)
        if keep is not None:
            _prune(Path(root), keep)
    _barrier()
    return final


def publish(tmp: Path, final: Path, index: dict) -> None:
    """Write ``index.json`` into the finished temporary folder ``tmp`` and rename it to ``final``."""
    with open(tmp / "index.json", "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if (p / "index.json").exists())
    for old in done[:-keep]:
        shutil.rmtree(old)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (temporary folders are ignored)."""
    done = sorted(p for p in Path(root).glob("step_*") if (p / "index.json").exists())
    return done[-1] if done else None


def find_checkpoint(path: str | Path) -> Path:
    """A step folder, or the newest complete one under a run folder or its ``checkpoints/`` folder."""
    path = Path(path)
    if (path / "index.json").exists():
        return path
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found is not None:
            return found
    raise CheckpointError(f"{path} holds no complete checkpoint (no index.json in it or under it)")


def read_index(folder: str | Path) -> dict:
    folder = Path(folder)
    index_path = folder / "index.json"
    if not index_path.is_file():
        raise CheckpointError(f"{index_path} is missing: {folder} is not a complete checkpoint")
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{index_path} is not valid JSON: {err}") from err
    if index.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{index_path} has format {index.get('format')}, expected {FORMAT_VERSION}")
    return index


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


def load_rank(folder: str | Path, rank: int, index: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Verify and load one rank's tensors and its ``extra`` dict."""
    folder = Path(folder)
    index = index or read_index(folder)
    if not 0 <= rank < index["world_size"]:
        raise CheckpointError(f"{folder} was saved by {index['world_size']} ranks; it has no rank {rank}")
    verify_files(folder, index, [rank])
    entry = index["ranks"][rank]
    return load_file(str(folder / entry["file"])), entry["extra"]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
