"""Read a sharded checkpoint without any process group: inspect it, or export one plain file.

Both go through :class:`polyshard.trainer.reshard.Source`, which checks every
rank file's sha256 first and rebuilds a global tensor from the pieces its
placement records locate. Export writes every ``model/...`` tensor, without
vocabulary or ZeRO padding, to one safetensors file. Its keys are the plain
model's parameter names.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from polyshard.trainer.checkpoint_format import MODEL, CheckpointError, Source
from polyshard.trainer.models import tied_names


def _opened(checkpoint: str | Path | Source) -> Source:
    return checkpoint if isinstance(checkpoint, Source) else Source(checkpoint)


def consolidate(folder: str | Path | Source) -> dict[str, torch.Tensor]:
    """The unsharded model weights saved in ``folder`` (verified first; nothing is half-loaded).

    A tied weight is saved once; its other names (the output head of tied
    embeddings) get equal copies, so the plain model loads with ``strict=True``.
    """
    source = _opened(folder)
    state = {key[len(MODEL) :]: source.whole(key) for key in sorted(source.pieces) if key.startswith(MODEL)}
    aliases = tied_names(source.config.model) if "config" in source.index else {}
    for alias, name in aliases.items():
        if name in state:
            state[alias] = state[name].clone()  # safetensors stores no shared tensors
    return dict(sorted(state.items()))


def export(folder: str | Path | Source, destination: str | Path) -> Path:
    """Write the consolidated weights of ``folder`` to one safetensors file (temp file, then rename)."""
    destination = Path(destination)
    if destination.is_dir():
        raise CheckpointError(
            f"{destination} is a folder; give the file to write, e.g. {destination / 'model.safetensors'}"
        )
    if not destination.parent.is_dir():
        raise CheckpointError(f"{destination.parent} does not exist; create it or choose another destination")
    state = consolidate(folder)
    tmp = destination.with_name(destination.name + ".tmp")
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        tmp.rename(destination)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a half-written file behind
        raise
    return destination


def describe(folder: str | Path | Source) -> str:
    """Mesh, step, every model tensor's global shape and size; checksums verified."""
    source = _opened(folder)
    lines = [
        f"checkpoint {source.folder}",
        f"step {source.step}, mesh {source.index['mesh']}, {source.index['world_size']} rank files, sha256 verified",
    ]
    total = 0
    for key in sorted(k for k in source.pieces if k.startswith(MODEL)):
        shape = tuple(source.global_shape(key))
        total += math.prod(shape)
        lines.append(f"  {key[len(MODEL) :]:<48} {str(list(shape)):<16} {math.prod(shape):>12,}")
    lines.append(f"{total:,} parameters")
    return "\n".join(lines)
