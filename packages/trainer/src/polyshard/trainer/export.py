"""Read a sharded checkpoint without any process group: inspect it, or export one plain file.

Everything comes from ``index.json``: the mesh, and for every rank the
placement record of each tensor it saved. A rank's coordinates follow from
the mesh (row-major, last axis fastest), and a record's ``local_slices`` say
which part of the global tensor that rank's piece is. Export copies every
``model/...`` piece into its place, drops vocabulary or ZeRO padding, and
writes one safetensors file whose keys are the plain model's parameter names.
Each rank file is checked against its sha256 before any tensor is read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from polyshard.mesh import MeshLayout, TensorPlacement
from polyshard.trainer.checkpoint import CheckpointError, read_index, verify_files

MODEL_PREFIX = "model/"


def _pieces(folder: Path, index: dict) -> dict[str, list[tuple[int, TensorPlacement | None]]]:
    """Global model tensor name -> [(rank, record)] of every rank holding a piece of it."""
    pieces: dict[str, list] = {}
    for rank, entry in enumerate(index["ranks"]):
        for key, record in entry["tensors"].items():
            if key.startswith(MODEL_PREFIX):
                record = TensorPlacement.from_json(record) if record is not None else None
                pieces.setdefault(key[len(MODEL_PREFIX) :], []).append((rank, record))
    return pieces


def consolidate(folder: str | Path) -> dict[str, torch.Tensor]:
    """The unsharded model weights saved in ``folder`` (verified first; nothing is half-loaded)."""
    folder = Path(folder)
    index = read_index(folder)
    verify_files(folder, index)
    layout = MeshLayout(index["mesh"])
    sizes = layout.as_dict()
    handles = {}
    try:
        for rank, entry in enumerate(index["ranks"]):
            handles[rank] = safe_open(str(folder / entry["file"]), framework="pt")
        out = {}
        for name, holders in sorted(_pieces(folder, index).items()):
            rank, record = holders[0]
            first = handles[rank].get_tensor(MODEL_PREFIX + name)
            if record is None:  # identical on every rank that holds it
                out[name] = first
                continue
            full = torch.zeros(record.tiled_shape, dtype=first.dtype)
            covered = torch.zeros(record.tiled_shape, dtype=torch.bool)
            for rank, rank_record in holders:
                slices = rank_record.local_slices(sizes, layout.coords(rank))
                full[slices] = handles[rank].get_tensor(MODEL_PREFIX + name).reshape(full[slices].shape)
                covered[slices] = True
            if not bool(covered.all()):
                raise CheckpointError(f"{folder}: the saved pieces of {name!r} do not cover the whole tensor")
            out[name] = full[tuple(slice(0, n) for n in record.global_shape)].clone()  # drop padding
        return out
    finally:
        handles.clear()


def export(folder: str | Path, destination: str | Path) -> Path:
    """Write the consolidated weights of ``folder`` to one safetensors file (temp file, then rename)."""
    destination = Path(destination)
    state = consolidate(folder)
    tmp = destination.with_name(destination.name + ".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    tmp.rename(destination)
    return destination


def describe(folder: str | Path) -> str:
    """Mesh, step, every model tensor's global shape and size; checksums verified."""
    folder = Path(folder)
    index = read_index(folder)
    verify_files(folder, index)
    lines = [
        f"checkpoint {folder}",
        f"step {index['step']}, mesh {index['mesh']}, {index['world_size']} rank files, sha256 verified",
    ]
    total = 0
    for name, holders in sorted(_pieces(folder, index).items()):
        record = holders[0][1]
        shape = tuple(record.global_shape) if record is not None else None
        if shape is None:
            with safe_open(str(folder / index["ranks"][holders[0][0]]["file"]), framework="pt") as f:
                shape = tuple(f.get_slice(MODEL_PREFIX + name).get_shape())
        numel = 1
        for n in shape:
            numel *= n
        total += numel
        lines.append(f"  {name:<48} {str(list(shape)):<16} {numel:>12,}")
    lines.append(f"{total:,} parameters")
    return "\n".join(lines)
