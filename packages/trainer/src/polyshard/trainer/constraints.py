"""Checks between config fields, run before any process starts.

Each check raises :class:`ConfigError` saying what is wrong and what would
work, e.g. ``parallel.tp=4 does not divide model.num_heads=6; choose tp in
[1, 2, 3, 6]``.
"""

from __future__ import annotations

from polyshard.mesh import divisors
from polyshard.trainer.config import Config
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.models import spec_of


def validate(config: Config, world_size: int | None = None) -> None:
    """Raise :class:`ConfigError` for the first constraint ``config`` breaks."""
    model, par, train = config.model, config.parallel, config.training
    if par.layout == "auto":
        raise ConfigError(
            "parallel.layout='auto' is resolved by `polyshard train` before launch (the planner picks the axes); "
            "start the run with `polyshard train CONFIG --layout auto`, or set the axes and layout='manual'"
        )
    if world_size is not None and par.world_size != world_size:
        raise ConfigError(
            f"the mesh dp={par.dp} x ep={par.ep} x pp={par.pp} x tp={par.tp} has {par.world_size} ranks "
            f"but {world_size} processes were asked for; use --nproc {par.world_size} or change the mesh"
        )
    _check_tensor_parallel(config)
    _check_pipeline(config)
    _check_experts(config)
    spec = spec_of(model)
    spec.check(config)  # the family's own constraints
    spec.task.check_config(config)
    data_ranks = par.data_ranks
    per_step = data_ranks * par.microbatches
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size={train.global_batch_size} does not split over "
            f"dp x ep = {data_ranks} data ranks x {par.microbatches} microbatches; "
            f"use a multiple of {per_step}"
        )


def _check_tensor_parallel(config: Config) -> None:
    model, tp = config.model, config.parallel.tp
    for name, value in (("model.num_heads", model.num_heads), ("model.num_kv_heads", model.kv_heads)):
        if value % tp:
            valid = divisors(model.kv_heads)  # kv_heads divides num_heads, so these divide both
            raise ConfigError(f"parallel.tp={tp} does not divide {name}={value}; choose tp in {valid}")
    if config.parallel.sequence_parallel and config.parallel.zero_stage > 0:
        # Norm weights under SP need their gradients summed over tp after backward, but ZeRO
        # reduce-scatters gradients during backward and keeps no full .grad to sum.
        raise ConfigError(
            f"parallel.sequence_parallel with parallel.zero_stage={config.parallel.zero_stage} is not supported; "
            "use zero_stage=0 with sequence parallelism, or turn sequence_parallel off"
        )
    if config.parallel.sequence_parallel and model.sequence_length % tp:
        # Offer only sizes that also pass the head and MLP checks above.
        widths = (model.kv_heads, model.mlp_width)
        valid = [d for d in divisors(model.sequence_length) if all(w % d == 0 for w in widths)]
        raise ConfigError(
            f"sequence parallelism splits the {model.sequence_length} positions over tp={tp}; "
            f"choose tp in {valid} or turn parallel.sequence_parallel off"
        )


def _check_pipeline(config: Config) -> None:
    model, par = config.model, config.parallel
    stages = par.pp * par.virtual_stages
    # The embedding and the head are pipeline layers too: num_layers blocks + 2.
    layers = model.num_layers + 2
    if stages > layers:
        raise ConfigError(
            f"pp={par.pp} x virtual_stages={par.virtual_stages} = {stages} pipeline stages but the model has only "
            f"{layers} layers (embedding, {model.num_layers} blocks, head); use at most {layers} stages"
        )
    if par.stage_layers is not None and (len(par.stage_layers) != stages or sum(par.stage_layers) != layers):
        raise ConfigError(
            f"parallel.stage_layers={par.stage_layers} must give {stages} pipeline stages (pp x virtual_stages) "
            f"layer counts that add up to {layers} (embedding, {model.num_layers} blocks, head)"
        )
    if par.schedule == "interleaved" and par.microbatches % par.pp:
        raise ConfigError(
            f"the interleaved schedule needs parallel.microbatches ({par.microbatches}) to be a multiple of "
            f"parallel.pp ({par.pp}); try microbatches={par.pp * max(1, par.microbatches // par.pp)}"
        )


def _check_experts(config: Config) -> None:
    if config.parallel.ep > 1 and not spec_of(config.model).has_experts:
        raise ConfigError(
            f"parallel.ep={config.parallel.ep} needs experts; set model.kind='moe-gpt' (a family with experts) or ep=1"
        )
