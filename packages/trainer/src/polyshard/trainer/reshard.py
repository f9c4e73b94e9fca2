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
import math
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from polyshard.mesh import MeshLayout, get_placement
from polyshard.trainer.checkpoint_format import (
    ASSETS,
    MASTER,
    RNG,
    CheckpointError,
    Source,
    StreamWriter,
    copy_assets,
    make_index,
    optim_key,
    publish,
    rank_entry,
    rank_file,
    step_dir,
)
from polyshard.trainer.config import MESH_AXES, Config, from_dict
from polyshard.trainer.constraints import validate
from polyshard.trainer.parallelize import Engine
from polyshard.trainer.records import Planned, plan_ranks
from polyshard.trainer.state import load_state_tensors, optimizer_entries, state_tensors

DEFAULT_BLOCK_BYTES = 64 << 20


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
    raw["parallel"].update({axis: int(mesh.get(axis, 1)) for axis in MESH_AXES})
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
    src: str | Path | Source, dst_root: str | Path, config: Config, *, max_block_bytes: int = DEFAULT_BLOCK_BYTES
) -> ReshardReport:
    """Write the checkpoint ``src`` for ``config``'s mesh as ``dst_root/step_N``, without processes.

    The result is what a run on the new layout would have saved: its
    ``--resume`` continues from it. The folder appears only when complete.
    ``src`` may be a :class:`Source` the caller already opened (and so verified).
    """
    started = time.perf_counter()
    validate(config)
    source = src if isinstance(src, Source) else Source(src)
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
            writer = StreamWriter(tmp / rank_file(rank), {k: (p.dtype, p.shape) for k, p in plan.items()})
            for key, item in plan.items():
                if key == RNG:
                    writer.write(key, source.read_piece(rng, RNG))
                    continue
                for block in _blocks(source, key, item, sizes, coords, max_block_bytes):
                    largest = max(largest, block.numel() * block.element_size())
                    writer.write(key, block)
            digest = writer.close()
            total += writer.data_bytes
            records = {k: p.record for k, p in plan.items()}
            entries.append(rank_entry(rank_file(rank), digest, records, source.extra()))
        assets = {ASSETS: copy_assets(source.assets(), tmp)} if source.assets() else {}
        index = make_index(
            source.step,
            config.parallel.mesh_axes,
            entries,
            dataclasses.asdict(config),
            resharded_from={"folder": str(source.folder), "mesh": source.index["mesh"]},
            **assets,
        )
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
            key = optim_key(name, state)
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
