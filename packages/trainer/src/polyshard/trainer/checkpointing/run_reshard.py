"""Move a checkpoint to another layout: offline (:func:`reshard`) or while loading (:func:`load_into`).

Both read a source the same way (``polyshard.checkpoint``: every saved piece's region of the
global tensor is known from its placement record). Offline, the target ranks' tensors come from
:mod:`polyshard.trainer.checkpointing.records` (names, shapes and the target config; no model and
no processes) and :func:`polyshard.checkpoint.write_resharded` writes them block by block.
Online, each rank asks for the records its live engine holds. What moves:

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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from polyshard.checkpoint import MASTER, OPTIM, RNG, Checkpoint, CheckpointError, CheckpointSource, Planned, optim_key
from polyshard.checkpoint.reshard import DEFAULT_BLOCK_BYTES, ReshardReport, read_planned, write_resharded
from polyshard.mesh import get_placement
from polyshard.models.common.lora import is_adapter
from polyshard.trainer.checkpointing.base_and_adapters import with_base
from polyshard.trainer.checkpointing.records import plan_ranks
from polyshard.trainer.checkpointing.run_export import check_saved_shapes, saved_config
from polyshard.trainer.checkpointing.state import load_state_tensors, optimizer_entries, state_tensors
from polyshard.trainer.config import MESH_AXES, Config, from_dict
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.engine.engine import Engine

# -- offline -------------------------------------------------------------------------------------------


def target_config(source: Checkpoint, mesh: Mapping[str, int], overrides: Mapping[str, object] | None = None) -> Config:
    """The source's config with the mesh (axes not named become 1) and other ``parallel`` fields replaced.
    Hybrid sharding is part of the layout: the target shards over all of dp unless ``overrides`` sets
    ``dp_shard``."""
    raw = dataclasses.asdict(saved_config(source))
    raw["parallel"].update({axis: int(mesh.get(axis, 1)) for axis in MESH_AXES})
    raw["parallel"]["dp_shard"] = None
    raw["parallel"].update(overrides or {})
    return from_dict(raw)


def reshard(
    src: str | Path | Checkpoint,
    dst_root: str | Path,
    config: Config,
    *,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
    overwrite: bool = False,
) -> ReshardReport:
    """Write the checkpoint ``src`` for ``config``'s mesh as ``dst_root/step_N``, without processes.

    The result is what a run on the new layout would have saved: its
    ``--resume`` continues from it. The folder appears only when complete, and replaces one already
    there only with ``overwrite`` (never the source: :mod:`polyshard.checkpoint.output`).
    ``src`` may be a :class:`Checkpoint` the caller already opened (and so verified).
    """
    validate(config)
    source = src if isinstance(src, Checkpoint) else Checkpoint(src)
    if dataclasses.asdict(config.model) != dataclasses.asdict(saved_config(source).model):
        raise CheckpointError("resharding changes only the layout; the target config's model must equal the source's")
    check_saved_shapes(source)
    plans = plan_ranks(config, source.params(), source.optim_state())
    return write_resharded(
        source,
        dst_root,
        config.parallel.mesh_axes,
        plans,
        dataclasses.asdict(config),
        max_block_bytes=max_block_bytes,
        overwrite=overwrite,
    )


# -- online --------------------------------------------------------------------------------------------


def _new_prediction_depth(source: CheckpointSource, key: str) -> bool:
    """Whether ``key`` is a multi-token prediction depth's weight (``model.mtp_depth``) that ``source`` lacks:
    a model that adds the depths to a trained one (a Hugging Face Llama, a run without them) starts them
    from their initial values, as DeepSeek-V3's depths start beside a trunk."""
    if ".mtp." not in key and not is_adapter(key):  # LoRA's factors start fresh beside a trained base too
        return False
    try:
        source.resolve(key)
    except CheckpointError:
        return True
    return False


def load_into(engine: Engine, source: CheckpointSource, *, weights_only: bool = False) -> None:
    """Fill a freshly built ``engine`` (any mesh) from ``source`` (any mesh): weights, optimizer state, RNG
    (``weights_only``: the weights and buffers, for a model that only runs forward, e.g. an evaluation).
    A LoRA checkpoint of adapters only is read with its recorded base behind it, checked first (collective:
    every rank loads)."""
    if isinstance(source, Checkpoint):
        source = with_base(source, collective=True)
    layout = engine.mesh.layout
    sizes, coords = layout.as_dict(), layout.coords(engine.mesh.rank)
    tensors = {}
    for key, local in state_tensors(engine).items():
        if weights_only and key.startswith(OPTIM):
            continue  # ZeRO's masters too: the engine runs forward only, or is loaded again before it steps
        if _new_prediction_depth(source, key):  # keeps the values it was built with
            tensors[key] = local.tensor.detach().clone()
        elif key != RNG:
            plan = Planned(local.placement, tuple(local.tensor.shape), local.tensor.dtype)
            tensors[key] = read_planned(source, key, plan, sizes, coords)
    saved = {} if weights_only else source.optim_state()
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
    rng = None if weights_only else source.rng_piece(coords)
    if rng is not None:
        tensors[RNG] = source.read_piece(rng, RNG)
    load_state_tensors(engine, tensors)
