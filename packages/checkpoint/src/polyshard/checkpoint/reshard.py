"""Offline resharding: write a checkpoint for another mesh, given what each target rank holds.

Every saved piece carries a placement record, so each piece's region of the global tensor is
known (:meth:`Checkpoint.read`). A target piece is a region of the global tensor too: it is
filled from the source pieces that overlap it, read with safetensors' lazy slicing, with zeros in
any padding rows. Replicated copies are read once. The source's sha256s were checked when it was
opened, so no tensor is used from a corrupt checkpoint.

What each target rank holds is a list of :class:`Planned` tensors per rank: this package needs no
model and no process group for it. The trainer computes them from its config
(``polyshard.trainer`` records); :func:`plans_from_records` makes them from placement records
alone when every rank holds every tensor.

Memory: one target tensor is written in blocks of at most ``max_block_bytes`` rows. Each block is
filled from reads of the same size, and source files are opened per read, so their mapped pages
are released. Peak tensor data is therefore about twice the block, whatever the size of the
checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polyshard.checkpoint.format import (
    ASSETS,
    RNG,
    CheckpointError,
    copy_assets,
    make_index,
    rank_entry,
    rank_file,
    step_dir,
    write_index,
)
from polyshard.checkpoint.output import check_destination, new_folder, reading
from polyshard.checkpoint.source import Checkpoint, CheckpointSource
from polyshard.checkpoint.writer import StreamWriter
from polyshard.mesh import MeshLayout, TensorPlacement

DEFAULT_BLOCK_BYTES = 64 << 20


@dataclass(frozen=True)
class Planned:
    """One tensor a target rank will hold: its record (None: the same whole tensor on every holder)."""

    record: TensorPlacement | None
    shape: tuple[int, ...]
    dtype: torch.dtype


def plans_from_records(
    records: Mapping[str, TensorPlacement | None], mesh: Mapping[str, int], source: Checkpoint
) -> list[dict[str, Planned]]:
    """Every rank of ``mesh`` holds every tensor of ``records`` (key -> its target record), in the
    source's dtype: a mesh without pipeline stages."""
    layout = MeshLayout(mesh)
    sizes = layout.as_dict()
    plan = {
        key: Planned(record, record.local_shape(sizes) if record else source.global_shape(key), source.dtype(key))
        for key, record in records.items()
    }
    return [dict(plan) for _ in range(layout.world_size)]


def target_region(
    source: CheckpointSource, key: str, plan: Planned, sizes: Mapping[str, int], coords: Mapping[str, int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, shape) in the global tensor ``key`` of the piece ``plan`` describes for the rank at ``coords``."""
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


def read_planned(
    source: CheckpointSource, key: str, plan: Planned, sizes: Mapping[str, int], coords: Mapping[str, int]
) -> torch.Tensor:
    """The whole local tensor ``plan`` describes for the rank at ``coords``."""
    return source.read(key, *target_region(source, key, plan, sizes, coords), plan.dtype)


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


def write_resharded(
    source: Checkpoint,
    dst_root: str | Path,
    mesh: Mapping[str, int],
    plans: Sequence[Mapping[str, Planned]],
    settings: Mapping[str, Any] | None = None,
    *,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
    overwrite: bool = False,
) -> ReshardReport:
    """Write ``source`` as ``dst_root/step_N`` for ``mesh``, rank ``r`` holding ``plans[r]``.

    Each rank also gets the generator of the source rank at its coordinates (modulo the source
    mesh), the source's ``extra`` state and assets; ``settings`` is the target run's config table.
    The folder appears only when complete; a failure leaves nothing behind. ``step_N`` may replace
    one already there only with ``overwrite``, and never the source or its run's checkpoints
    (:mod:`polyshard.checkpoint.output`).
    """
    started = time.perf_counter()
    layout = MeshLayout(mesh)
    if len(plans) != layout.world_size:
        raise CheckpointError(f"{len(plans)} rank plans for a mesh {dict(mesh)} of {layout.world_size} ranks")
    sizes = layout.as_dict()
    final = step_dir(Path(dst_root), source.step)
    check_destination(final, folder=True, overwrite=overwrite, protected=reading(source.folder), make_parents=True)
    entries, total, largest = [], 0, 0
    with new_folder(final, overwrite=overwrite, make_parents=True) as tmp:
        for rank, rank_plan in enumerate(plans):
            coords = layout.coords(rank)
            plan = dict(rank_plan)
            rng = source.rng_piece(coords)
            if rng is not None:
                plan[RNG] = Planned(None, rng.shape, rng.dtype)
            writer = StreamWriter(tmp / rank_file(rank), {k: (p.dtype, p.shape) for k, p in plan.items()})
            try:
                for key, item in plan.items():
                    if key == RNG and rng is not None:
                        writer.write(key, source.read_piece(rng, RNG))
                        continue
                    for block in _blocks(source, key, item, sizes, coords, max_block_bytes):
                        largest = max(largest, block.numel() * block.element_size())
                        writer.write(key, block)
                digest = writer.close()
            except BaseException:
                writer.abort()
                raise
            total += writer.data_bytes
            records = {k: p.record for k, p in plan.items()}
            entries.append(rank_entry(rank_file(rank), digest, records, source.extra()))
        assets = {ASSETS: copy_assets(source.assets(), tmp)} if source.assets() else {}
        index = make_index(
            source.step,
            dict(mesh),
            entries,
            settings,
            resharded_from={"folder": str(source.folder), "mesh": source.mesh},
            **assets,
        )
        write_index(tmp, index)  # new_folder renames it into place; any failure leaves nothing behind
    return ReshardReport(
        final, source.step, source.mesh, index["mesh"], len(entries), total, largest, time.perf_counter() - started
    )


def _blocks(
    source: Checkpoint,
    key: str,
    plan: Planned,
    sizes: Mapping[str, int],
    coords: Mapping[str, int],
    max_block_bytes: int,
) -> Iterator[torch.Tensor]:
    """The target tensor in row blocks of at most ``max_block_bytes`` (at least one row each)."""
    start, shape = target_region(source, key, plan, sizes, coords)
    return source.read_blocks(key, start, shape, plan.dtype, max_block_bytes)
