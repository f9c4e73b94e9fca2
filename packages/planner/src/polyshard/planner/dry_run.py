"""What a run would do, without starting it: the mesh, every group, memory and communication per rank.

Used by ``polyshard train --dry-run``. The parameter count is exact (the
model is built on the meta device, which allocates nothing); the memory per
rank is the layout planner's (:mod:`polyshard.planner`), the same
numbers ``polyshard plan`` prints for this layout: model states to the byte
as the engine holds them (ZeRO padding and all), activations counted from
what each block saves for backward times the in-flight microbatches the
pipeline simulator finds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from polyshard.cp import split_context_group
from polyshard.mesh import MeshLayout
from polyshard.models import active_parameter_count, build_model, layer_of, parameter_count, spec_of, tied_names
from polyshard.models.moe_gpt.model import routing_summary
from polyshard.planner.activations import activation_bytes
from polyshard.planner.comm import bytes_per_axis, rank_traffic
from polyshard.planner.lora_states import adapter_shapes
from polyshard.planner.model_states import rank_model_states
from polyshard.pp import make_schedule
from polyshard.trainer.config import Config
from polyshard.trainer.config.lora import LoRAConfig
from polyshard.trainer.engine.layout import layer_costs, pipeline_bounds
from polyshard.trainer.engine.lora import lora_targets
from polyshard.trainer.engine.schedule import schedule_of


def describe(config: Config) -> str:
    """A printable plan: mesh, groups and memory per rank."""
    par = config.parallel
    layout = MeshLayout(par.mesh_axes)
    lines = [f"mesh: {layout} ({layout.world_size} processes; the last axis varies fastest)"]
    for rank in range(layout.world_size):
        coords = " ".join(f"{a}={c}" for a, c in layout.coords(rank).items())
        lines.append(f"  rank {rank}: {coords}")
    lines.append("groups:")
    for subset in layout.axis_subsets():
        if all(layout.size(a) > 1 for a in subset):  # an axis of size 1 adds no new group
            lines.append(f"  {' x '.join(subset):<16} {layout.groups(subset)}")
    if par.cp_style == "ulysses+ring" and par.cp_ulysses:  # the 2-D scheme's parts of each cp group
        parts = [split_context_group(ranks, par.cp_ulysses) for ranks in layout.groups("cp")]
        lines.append(f"  {'cp_ulysses':<16} {[g for inner, _ in parts for g in inner]} (all-to-all)")
        lines.append(f"  {'cp_ring':<16} {[g for _, outer in parts for g in outer]} (ring)")
    skeleton = build_model(config.model, layers=())  # the meta device: shapes only
    shapes = {n: p.shape for n, p in skeleton.named_parameters()}
    costs = layer_costs(shapes, tied_names(config.model))  # a tied head holds its copy of the embedding
    schedule = make_schedule(par.schedule, par.pp, par.microbatches, par.virtual_stages)
    bounds = pipeline_bounds(config, shapes)
    per_stage, per_pp_rank = _held_counts(config, shapes, costs, bounds, schedule.rank_of)
    lines.append(f"pipeline ({par.schedule}, {par.microbatches} microbatches; layer 0 embeds, the last is the head):")
    for stage, layers in enumerate(bounds):
        lines.append(
            f"  stage {stage} on pp rank {schedule.rank_of(stage)}: layers {layers.start}-{layers.stop - 1} "
            f"({per_stage[stage]:,} parameters)"
        )
    num_params = parameter_count(config.model)
    heaviest = max(per_pp_rank.values())  # pipeline ranks hold unequal shares; the largest sets the need
    active = ""
    if spec_of(config.model).has_experts:  # what a token computes with: top_k of each sparse block's experts
        active = f" ({active_parameter_count(config.model):,} active per token)"
    lines.append(
        f"model: {config.model.kind}, {num_params:,} parameters{active}; the heaviest pipeline rank holds {heaviest:,}"
    )
    if spec_of(config.model).has_experts:
        lines.append(f"  {routing_summary(config.model)}")
    if config.lora is not None:
        lines.append(f"  {_lora_summary(config, config.lora, num_params)}")
    if par.hybrid:
        shard_axes = [a for a in par.shard_axes if a == "dp_shard" or par.mesh_axes[a] > 1]
        lines.append(
            f"hybrid sharding: ZeRO-{par.zero_stage} shards over {' x '.join(shard_axes)} "
            f"(dp_shard={par.dp_shard}) and each shard has {par.dp_replicate} copies over dp_replicate"
        )
    lines.append(
        f"memory per rank (estimate: the planner's, as `polyshard plan` prints it; ZeRO-{par.zero_stage}, "
        f"{config.training.precision}, {_OPTIMIZER_STATE[config.optimizer.name]}, "
        f"activation checkpointing {config.training.activation_checkpointing or 'none'}):"
    )
    for rank in range(par.pp):
        states, acts = rank_model_states(config, rank), activation_bytes(config, rank)
        lines.append(
            f"  pp rank {rank}: params {_mib(states.params)}, grads {_mib(states.grads)}, optimizer "
            f"{_mib(states.optimizer)} = model states {_mib(states.total)}; activations {_mib(acts)}; "
            f"total {_mib(states.total + acts)}"
        )
    lines.append("communication per step (estimate: the wire bytes one rank sends, by axis):")
    for rank in range(par.pp):
        sent = bytes_per_axis(rank_traffic(config, rank), par.microbatches)
        axes = ", ".join(f"{axis} {_mib(nbytes)}" for axis, nbytes in sorted(sent.items()) if nbytes)
        lines.append(f"  sent by pp rank {rank}: {axes or 'nothing'}")
    lines += lr_plot(config)
    return "\n".join(lines)


def _lora_summary(config: Config, lora: LoRAConfig, num_params: int) -> str:
    """What a LoRA run (``lora``: its section) trains and keeps: the adapters' parameters, the base's dtype."""
    targets = lora_targets(config)
    trained = sum(math.prod(shape) for shape in adapter_shapes(config).values())
    experts = " and every routed expert" if lora.experts else ""
    dtype = config.model.frozen_dtype or ("bfloat16" if config.training.precision == "bf16" else "float32")
    return (
        f"LoRA rank {lora.rank} on {len(targets)} linears{experts}: {trained:,} trainable parameters "
        f"({100 * trained / num_params:.2f}% of the model), the only ones with gradients and optimizer state; "
        f"the frozen base's matrices in {dtype}"
    )


def _held_counts(
    config: Config,
    shapes: Mapping[str, Sequence[int]],
    costs: list[int],
    bounds: list[range],
    rank_of: Callable[[int], int],
) -> tuple[list[int], dict[int, int]]:
    """Parameters each stage and each pipeline rank holds. ``costs`` counts a tied head with its own copy
    of the embedding; where one stage (or one rank) holds both ends of a tie it holds one tensor, so the
    copy is taken off there. A tie across ranks keeps a copy on each, summed by their gradients."""
    per_stage = [sum(costs[i] for i in layers) for layers in bounds]
    per_pp_rank: dict[int, int] = {}
    for stage, count in enumerate(per_stage):
        per_pp_rank[rank_of(stage)] = per_pp_rank.get(rank_of(stage), 0) + count
    stage_of = {i: stage for stage, layers in enumerate(bounds) for i in layers}
    for alias, name in tied_names(config.model).items():
        first, last = stage_of[layer_of(name)], stage_of[layer_of(alias)]
        if first == last:
            per_stage[last] -= math.prod(shapes[name])
        if rank_of(first) == rank_of(last):
            per_pp_rank[rank_of(last)] -= math.prod(shapes[name])
    return per_stage, per_pp_rank


def lr_plot(config: Config, width: int = 60, height: int = 6) -> list[str]:
    """The learning-rate schedule as a small text plot: one column per stretch of steps, its height the
    mean learning rate there, from 0 to ``optimizer.lr``."""
    schedule, steps, lr, chosen = schedule_of(config), config.training.steps, config.optimizer.lr, config.lr_schedule
    columns = min(width, steps)
    means = []
    for c in range(columns):
        part = range(c * steps // columns, max((c + 1) * steps // columns, c * steps // columns + 1))
        means.append(sum(schedule(step) for step in part) / len(part))
    title = f"learning rate ({chosen.name}"
    if chosen.name == "wsd":
        title += f", decay over the last {chosen.decay_steps(steps)} steps, {chosen.decay_shape}"
    lines = [f"{title}; {chosen.warmup_steps} warmup steps; peak {lr:g}, end {schedule(steps - 1):.3g}):"]
    for row in range(height, 0, -1):
        bar = "".join("#" if mean >= (row - 0.5) / height * lr else " " for mean in means)
        lines.append(f"  |{bar}")
    lines.append(f"  +{'-' * columns} step 1..{steps}")
    return lines


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


_OPTIMIZER_STATE = {
    "adamw": "AdamW",
    "muon": "Muon (1 buffer per matrix element)",
}
