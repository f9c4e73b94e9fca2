"""The run's config made ready for evaluation: its model as saved, on the layout asked for.

Evaluation changes only how the work is laid out, never the numbers a layout computes:

* ZeRO is off (stage 0): each data rank holds its stages' weights whole, so data ranks with different
  numbers of requests need not run their forwards in step (ZeRO-3 gathers weights over dp in each one);
* sequence parallelism is off, so any length of request runs on tp;
* ``training.compile`` is off (every new request length would compile again) and the head gives
  logits (``training.loss_chunks``), which scoring reads;
* the batch settings only have to fit the layout: evaluation batches with ``--batch-size``.

Refused: context parallelism (``cp`` > 1), where each rank would hold chunks of every sequence;
evaluate the same checkpoint with a layout without it (``--mesh``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from polyshard.checkpoint import Checkpoint
from polyshard.trainer.checkpointing.run_export import saved_config
from polyshard.trainer.checkpointing.run_reshard import target_config
from polyshard.trainer.config import MESH_AXES, Config
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError


def evaluation_config(source: Checkpoint, mesh: Mapping[str, int] | None = None) -> Config:
    """``source``'s config on ``mesh`` (axes left out are 1; None: the layout it was saved with), changed
    as the module says; a :class:`ConfigError` names what the layout cannot do."""
    saved = saved_config(source)
    axes = {axis: getattr(saved.parallel, axis) for axis in MESH_AXES} if mesh is None else dict(mesh)
    if axes.get("cp", 1) > 1:
        others = ",".join(f"{axis}={size}" for axis, size in axes.items() if axis != "cp" and size > 1) or "dp=1"
        raise ConfigError(
            f"polyshard eval runs on dp, tp, pp and ep; cp={axes['cp']} is refused (each rank would hold "
            f"chunks of every sequence): give a layout without it, e.g. --mesh {others}"
        )
    parallel = {"zero_stage": 0, "sequence_parallel": False}
    config = target_config(source, axes, parallel)
    training = dataclasses.replace(
        config.training,
        compile=False,
        loss_chunks=0,
        global_batch_size=config.parallel.data_ranks * config.parallel.microbatches,
    )
    config = dataclasses.replace(config, training=training)
    validate(config)
    return config
