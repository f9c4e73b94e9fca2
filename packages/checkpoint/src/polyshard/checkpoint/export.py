"""Read a checkpoint without any process group: describe it, gather its weights, or export one plain file.

All go through :class:`~polyshard.checkpoint.source.Checkpoint`, which checks every rank file's
sha256 first and rebuilds a global tensor from the pieces its placement records locate. Export
writes every ``model/...`` tensor, without vocabulary or ZeRO padding, to one safetensors file
whose keys are the plain model's parameter names. It streams: one block of one tensor is held at
a time, so a model larger than memory exports.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from polyshard.checkpoint.format import MODEL, CheckpointError
from polyshard.checkpoint.output import check_destination, new_file, reading
from polyshard.checkpoint.source import Checkpoint
from polyshard.checkpoint.writer import StreamWriter

DEFAULT_BLOCK_BYTES = 64 << 20


def _opened(checkpoint: str | Path | Checkpoint) -> Checkpoint:
    return checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)


def model_names(source: Checkpoint, aliases: Mapping[str, str] | None = None) -> dict[str, str]:
    """Plain parameter name -> the saved key holding its values, sorted by name. A tied weight is saved
    once; ``aliases`` (other name -> saved name, e.g. a tied output head -> the embedding) adds its
    other names, so the plain model loads with ``strict=True``."""
    names = {key[len(MODEL) :]: key for key in source.pieces if key.startswith(MODEL)}
    for alias, name in (aliases or {}).items():
        if name in names:
            names[alias] = names[name]
    return dict(sorted(names.items()))


def consolidate(
    checkpoint: str | Path | Checkpoint, aliases: Mapping[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """The unsharded model weights in memory (verified first; nothing is half-loaded); see :func:`model_names`."""
    source = _opened(checkpoint)
    # safetensors stores no shared tensors: an alias gets its own copy.
    return {name: source.whole(key) for name, key in model_names(source, aliases).items()}


def blocks(source: Checkpoint, key: str, max_block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[torch.Tensor]:
    """The global tensor ``key`` in row blocks of at most ``max_block_bytes`` (at least one row each)."""
    shape = source.global_shape(key)
    return source.read_blocks(key, tuple(0 for _ in shape), shape, source.dtype(key), max_block_bytes)


def export(
    checkpoint: str | Path | Checkpoint,
    destination: str | Path,
    aliases: Mapping[str, str] | None = None,
    *,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the consolidated weights of ``checkpoint`` to one safetensors file, one block at a time,
    under a temporary name renamed when complete. An existing file is replaced only with ``overwrite``;
    the checkpoint itself never (:mod:`polyshard.checkpoint.output`).
    ``metadata`` (strings by name) goes into the header's ``__metadata__``: the model's settings, say."""
    destination = Path(destination)
    if destination.is_dir() and not destination.is_symlink():
        raise CheckpointError(
            f"{destination} is a folder; give the file to write, e.g. {destination / 'model.safetensors'}"
        )
    source = _opened(checkpoint)
    check_destination(destination, folder=False, overwrite=overwrite, protected=reading(source.folder))
    names = model_names(source, aliases)
    with new_file(destination, overwrite=overwrite) as tmp:
        writer = StreamWriter(tmp, {n: (source.dtype(k), source.global_shape(k)) for n, k in names.items()}, metadata)
        try:
            for name, key in names.items():
                for block in blocks(source, key, max_block_bytes):
                    writer.write(name, block)
            writer.close()
        except BaseException:
            writer.abort()  # new_file removes the partial file
            raise
    return destination


def describe(checkpoint: str | Path | Checkpoint) -> str:
    """Mesh, step, every model tensor's global shape and size; checksums verified."""
    source = _opened(checkpoint)
    lines = [
        f"checkpoint {source.folder}",
        f"step {source.step}, mesh {source.mesh}, {source.index['world_size']} rank files, sha256 verified",
    ]
    total = 0
    for key in sorted(k for k in source.pieces if k.startswith(MODEL)):
        shape = tuple(source.global_shape(key))
        total += math.prod(shape)
        lines.append(f"  {key[len(MODEL) :]:<48} {str(list(shape)):<16} {math.prod(shape):>12,}")
    lines.append(f"{total:,} parameters")
    return "\n".join(lines)
