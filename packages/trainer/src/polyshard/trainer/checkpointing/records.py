"""Where each saved tensor lives for a config, worked out from names and shapes only.

A training run attaches placement records to its tensors as tp, ep and dp
shard them, and saves those records. Offline resharding has no model and no
processes, so it needs the same records for a layout nobody has trained on
yet. This module computes them from the rules the packages publish:

* tp: :func:`polyshard.tp.planned_placement` reads the trainer's tp plan;
* ep: :func:`polyshard.ep.planned_expert_placement` reads the MoE names;
* pp: :func:`pipeline_bounds` is the split :func:`build_engine` uses;
* dp/ZeRO: :func:`polyshard.dp.shard_record` adds the dim-0 shards;
* buffers (a sigmoid router's bias): whole on every rank of their layer, no optimizer state,
  known from the model built on the meta device.

``tests/trainer/test_reshard.py`` checks the result against the records that
real runs save, layout by layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from polyshard.checkpoint import MASTER, Planned, model_key, optim_key
from polyshard.dp import ShardSpec, shard_record
from polyshard.ep import planned_expert_placement
from polyshard.mesh import MeshLayout, Replicate, Shard, TensorPlacement
from polyshard.models import build_model, layer_of, spec_of, tied_names
from polyshard.models.common.lora import is_adapter, is_expert_adapter
from polyshard.pp import make_schedule
from polyshard.tp import planned_placement
from polyshard.tp.plan import Plan
from polyshard.trainer.checkpointing.state import buffer_record, persistent_buffers
from polyshard.trainer.config import Config
from polyshard.trainer.engine.layout import keeps_masters, pipeline_bounds, tp_plan


def model_buffers(config: Config) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The model's persistent buffers by name: (dtype, shape), from the model built on the meta device."""
    skeleton = build_model(config.model, layers=())
    return {name: (b.dtype, tuple(b.shape)) for name, b in persistent_buffers(skeleton)}


def model_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """The model's parameters by name: their global shapes, from the model built on the meta device."""
    return {name: tuple(p.shape) for name, p in build_model(config.model, layers=()).named_parameters()}


def model_dtype(config: Config) -> torch.dtype:
    # ZeRO-3 saves its fp32 master rows as the parameters; stages 0-2 under bf16 keep bf16 parameters.
    bf16 = config.training.precision == "bf16" and config.parallel.zero_stage < 3
    return torch.bfloat16 if bf16 else torch.float32


def base_record(config: Config, name: str, shape: Sequence[int]) -> TensorPlacement:
    """A parameter's record after tp and ep, before dp (the order :func:`build_engine` applies them)."""
    shape = tuple(shape)
    record = TensorPlacement(name, shape)
    if config.parallel.tp > 1:
        plan = tp_plan(config)
        record = _adapter_record(plan, name, shape, config.parallel.tp) or planned_placement(
            plan, name, shape, config.parallel.tp
        )
    if spec_of(config.model).has_experts:
        record = planned_expert_placement(name, shape) or record
    return dataclasses.replace(record, layer=layer_of(name))


def _adapter_record(plan: Plan, name: str, shape: tuple[int, ...], tp: int) -> TensorPlacement | None:
    """A LoRA factor's record over tp, from its base linear's (:mod:`polyshard.models.common.lora`): beside a
    column-parallel base (weight split by rows) B is split by rows, beside a row-parallel one (split by
    columns) A by columns; the other factor is whole on every tp rank. None for a name that is no factor."""
    if not is_adapter(name) or is_expert_adapter(name):
        return None  # the routed experts' adapters are whole on every tp rank, as the experts are
    linear, part, _ = name.rsplit(".", 2)
    # A linear's split does not depend on its shape (only vocabulary rows are padded, and no adapter sits
    # beside an embedding or the head), so the factor's shape stands in for its base's.
    split = planned_placement(plan, f"{linear}.weight", shape, tp).placement("tp")
    dim = {"lora_B": 0, "lora_A": 1}[part]
    placement = Shard(dim) if split == Shard(dim) else Replicate()
    return TensorPlacement(name, shape, (("tp", placement),))


def is_expert(config: Config, record: TensorPlacement) -> bool:
    return spec_of(config.model).has_experts and record.placement("ep") != Replicate()


def data_axes(config: Config, record: TensorPlacement) -> tuple[str, ...]:
    """Mesh axes the data-parallel wrapper spans for this parameter (experts: dp x cp, below ZeRO-3):
    its replicas, over which its gradient averages (hybrid sharding: dp_replicate then the shard axes)."""
    return config.parallel.replicate_axes + shard_axes(config, record)


def shard_axes(config: Config, record: TensorPlacement) -> tuple[str, ...]:
    """Mesh axes ZeRO shards this parameter over: :func:`data_axes` less hybrid sharding's dp_replicate."""
    if is_expert(config, record) and config.parallel.zero_stage < 3:
        return config.parallel.expert_shard_axes
    return config.parallel.shard_axes


def plan_ranks(
    config: Config,
    params: Mapping[str, tuple[int, ...]],
    optim_state: Mapping[str, Mapping[str, tuple[torch.dtype, tuple[int, ...]]]],
) -> list[dict[str, Planned]]:
    """For every rank of ``config``'s mesh, the ``model/`` and ``optim/`` tensors it saves.

    ``params``: global parameter name -> global shape. ``optim_state``: name ->
    {state key: (dtype, shape of a scalar)} for the optimizer state to carry
    (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``); masters are added or left
    out as ``config`` needs.
    """
    par = config.parallel
    layout = MeshLayout(par.mesh_axes)
    sizes = layout.as_dict()
    buffers = {name: info for name, info in model_buffers(config).items() if name in params}
    params = {name: shape for name, shape in params.items() if name not in buffers}
    bases = {name: base_record(config, name, shape) for name, shape in params.items()}
    # The engine's split, from the model's own parameters: neither LoRA's factors nor a base an
    # adapters-only checkpoint leaves out move a layer to another stage.
    bounds = pipeline_bounds(config, model_shapes(config))
    schedule = make_schedule(par.schedule, par.pp, par.microbatches, par.virtual_stages)

    def data_records(record: TensorPlacement) -> tuple[TensorPlacement, TensorPlacement]:
        """(parameter record, optimizer-state record) once dp/ZeRO is applied."""
        replicated = record
        for axis in data_axes(config, record):
            replicated = replicated.with_axis(axis, Replicate())
        if par.zero_stage == 0:
            return replicated, replicated
        axes = shard_axes(config, record)
        n = math.prod(sizes[a] for a in axes)
        sharded = shard_record(replicated, record.name, ShardSpec(record.local_shape(sizes), n), axes)
        return (sharded if par.zero_stage == 3 else replicated), sharded

    placed = {name: data_records(record) for name, record in bases.items()}
    # The layers whose holders save each parameter: its own, and for a tied weight its alias's too
    # (a pipeline's last stage saves its copy of a tied embedding under the embedding's name).
    users = {name: {layer_of(name)} for name in params}
    for alias, name in tied_names(config.model).items():
        if name in users:
            users[name].add(layer_of(alias))
    out = []
    for rank in range(layout.world_size):
        stages = schedule.stages_of(layout.coords(rank)["pp"])
        layers = {i for s in stages for i in bounds[s]}
        tensors: dict[str, Planned] = {}
        for name in sorted(params):
            if not users[name] & layers:
                continue
            param_record, state_record = placed[name]
            tensors[model_key(name)] = Planned(param_record, param_record.local_shape(sizes), model_dtype(config))
            state_shape = state_record.local_shape(sizes)
            if keeps_masters(config):
                tensors[optim_key(name, MASTER)] = Planned(state_record, state_shape, torch.float32)
            for key, (dtype, shape) in sorted(optim_state.get(name, {}).items()):
                if key == MASTER:
                    continue
                if len(shape) == 0:  # AdamW's step counter: one number, the same everywhere
                    tensors[optim_key(name, key)] = Planned(None, (), dtype)
                else:
                    tensors[optim_key(name, key)] = Planned(state_record, state_shape, dtype)
        for name, (dtype, shape) in buffers.items():
            if layer_of(name) in layers:
                tensors[model_key(name)] = Planned(buffer_record(name, torch.empty(shape, device="meta")), shape, dtype)
        out.append(tensors)
    return out
