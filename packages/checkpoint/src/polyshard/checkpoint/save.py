"""Saving and opening checkpoints: one safetensors file per rank plus a JSON index.

Layout of ``<dir>/step_00000100/``::

    rank_00000.safetensors   this rank's local tensors (model, optimizer state, RNG)
    rank_00001.safetensors
    index.json               mesh, step, per-tensor placement records, a sha256 per file, extra state

Every rank writes its file into a temporary folder of ours beside it
(``.polyshard-tmp-step_00000100-<random>``, :mod:`polyshard.checkpoint.output`); once all are written
rank 0 writes the index and renames the folder into place, so a reader never
sees a half-written checkpoint (the next save removes a temporary folder a
killed save left behind). Nothing is pickled. The placement records
(global name, global shape, Replicate/Shard per mesh axis) are what offline
resharding reads; it never needs the model or a process group.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from polyshard.checkpoint.format import (
    ASSETS,
    CheckpointError,
    copy_assets,
    make_index,
    publish,
    rank_entry,
    rank_file,
    read_index,
    sha256,
    step_dir,
    verify_files,
)
from polyshard.checkpoint.output import stale_temporaries, temporary_folder
from polyshard.checkpoint.source import Checkpoint
from polyshard.mesh import TensorPlacement

_Opened = TypeVar("_Opened")


@dataclass(frozen=True)
class LocalTensor:
    """One tensor a rank saves, with its placement record (None: identical on every rank)."""

    tensor: torch.Tensor
    placement: TensorPlacement | None = None


def save_checkpoint(
    root: str | Path,
    step: int,
    tensors: Mapping[str, LocalTensor],
    *,
    mesh_axes: Mapping[str, int],
    extra: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    keep: int | None = None,
    assets: Mapping[str, Path] | None = None,
    after_write: Callable[[], None] | None = None,
    group: dist.ProcessGroup | None = None,
    copy: bool = True,
) -> Path:
    """Collectively save this rank's ``tensors``; returns the finished folder.

    ``extra`` (JSON-serialisable, gathered from every rank) lands in the index
    under ``"ranks"``; use it for data positions and other small state.
    ``config`` (the run's settings as a dict) lets offline tools lay the
    checkpoint out for another mesh. ``assets`` (name -> file, read on rank 0) are copied in
    beside the tensors and verified like them: the run's tokenizer. ``after_write`` runs on every rank
    once its own file is written, before the index is (the trainer's fault injection kills a rank there).
    ``group`` (every rank, default the world) carries the save's barriers and gather: a save in a
    background thread (:class:`~polyshard.checkpoint.background.BackgroundSaver`) has a group of its own.
    ``copy=False``: the tensors are already private CPU copies (the background saver's), written as they are.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = step_dir(Path(root), step)
    made = None
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in stale_temporaries(final.parent, "step_*"):  # left by a save that was killed midway
            shutil.rmtree(stale, ignore_errors=True)
        made = str(temporary_folder(final))  # a name of ours alone (output.py), handed to every rank
    tmp = Path(_gather(made, group)[0])
    path = tmp / rank_file(rank)
    # clone(): safetensors refuses tensors that share memory (fp32 ZeRO masters are views of the
    # parameters at stages 1-2 and of the shards at stage 3).
    if copy:
        tensors = {name: LocalTensor(t.tensor.detach().cpu().clone(), t.placement) for name, t in tensors.items()}
    save_file({name: t.tensor.contiguous() for name, t in tensors.items()}, str(path))
    if after_write is not None:
        after_write()
    entry = rank_entry(path.name, sha256(path), {name: t.placement for name, t in tensors.items()}, extra or {})
    entries = _gather(entry, group)
    if rank == 0:
        more = {ASSETS: copy_assets(assets, tmp)} if assets else {}
        publish(tmp, final, make_index(step, mesh_axes, entries, config, **more))
        if keep is not None:
            _prune(Path(root), keep)
    _barrier(group)
    return final


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first (temporary folders are ignored)."""
    root = Path(root)
    return sorted(p for p in root.glob("step_*") if (p / "index.json").exists()) if root.is_dir() else []


def _prune(root: Path, keep: int) -> None:
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def open_checkpoint(path: str | Path, on_skip: Callable[[Path, CheckpointError], None] | None = None) -> Checkpoint:
    """``path``'s checkpoint, opened and verified. A step folder is taken as named; under a run folder
    (or its ``checkpoints/``) the newest *valid* one is taken, and each newer one that fails
    verification is reported to ``on_skip(folder, error)`` and passed over, so a corrupt last save
    does not lose the run."""
    return _newest_valid(Path(path), Checkpoint, on_skip)


def find_checkpoint(path: str | Path) -> Path:
    """A step folder, or the newest complete one under a run folder or its ``checkpoints/`` folder whose
    index reads (cheap: no sha256 is computed), so a launcher can refuse a damaged one before any process
    starts; the workers' :func:`open_checkpoint` verifies the files."""

    def readable(folder: Path) -> Path:
        read_index(folder)
        return folder

    return _newest_valid(Path(path), readable)


def _newest_valid(
    path: Path, opened: Callable[[Path], _Opened], on_skip: Callable[[Path, CheckpointError], None] | None = None
) -> _Opened:
    if (path / "index.json").exists():
        return opened(path)
    for root in (path, path / "checkpoints"):
        done = complete_checkpoints(root)
        for folder in reversed(done):
            try:
                return opened(folder)
            except CheckpointError as err:
                if on_skip is not None:
                    on_skip(folder, err)
                last = err
        if done:
            raise CheckpointError(f"no checkpoint under {root} is valid; the oldest failed with: {last}")
    raise CheckpointError(f"{path} holds no complete checkpoint (no index.json in it or under it)")


def load_rank(
    folder: str | Path, rank: int, index: dict[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Verify and load one rank's tensors and its ``extra`` dict."""
    folder = Path(folder)
    index = index or read_index(folder)
    if not 0 <= rank < index["world_size"]:
        raise CheckpointError(f"{folder} was saved by {index['world_size']} ranks; it has no rank {rank}")
    verify_files(folder, index, [rank])
    entry = index["ranks"][rank]
    return load_file(str(folder / entry["file"])), entry["extra"]


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _gather(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out
