"""What a run would do, without starting it: the mesh, every group, memory per rank.

Used by ``polyshard train --dry-run``. The parameter count is exact (the
model is built on the meta device, which allocates nothing); the memory
figures are the usual estimates:

* model states per parameter (ZeRO paper, Rajbhandari et al. 1910.02054):
  fp32 training keeps 4 B weight + 4 B grad + 8 B Adam moments = 16 B; bf16
  mixed precision keeps 2 + 2 + 12 (fp32 master, m, v) = 16 B. ZeRO-1 shards
  the optimizer part over dp, ZeRO-2 also the grads, ZeRO-3 everything.
* activations per transformer layer per microbatch (Korthikanti et al.
  2205.05198, eq. 2): s·b·h·(34 + 5·a·s/h) bytes in 16-bit, divided by tp with
  sequence parallelism (by tp for the 24 bytes inside the TP regions
  otherwise). Doubled for fp32.
"""

from __future__ import annotations

import math

from polyshard.mesh import MeshLayout
from polyshard.pp import make_schedule
from polyshard.trainer.config import Config
from polyshard.trainer.models import build_model, tied_names
from polyshard.trainer.parallelize import layer_costs, pipeline_bounds


def parameter_count(config: Config) -> int:
    model = build_model(config.model, layers=())  # the meta device: shapes only
    return sum(p.numel() for p in model.parameters())


def model_state_bytes_per_rank(config: Config, rank_params: int) -> float:
    """Weights, gradients and AdamW state of ``rank_params`` parameters (what one pipeline rank holds:
    all its stages, a tied head's copy included) on one rank, after tp and ZeRO split them."""
    par = config.parallel
    local = rank_params / par.tp
    weight, grad, optim = (2, 2, 12) if config.training.precision == "bf16" else (4, 4, 8)
    n = math.prod(par.mesh_axes[axis] for axis in par.replica_axes)  # ZeRO shards over the replicas
    if par.zero_stage >= 1:
        optim /= n
    if par.zero_stage >= 2:
        grad /= n
    if par.zero_stage >= 3:
        weight /= n
    return local * (weight + grad + optim)


def activation_bytes_per_rank(config: Config) -> float:
    model, par, train = config.model, config.parallel, config.training
    s, h, a = model.sequence_length, model.hidden, model.num_heads
    b = train.global_batch_size // (par.data_ranks * par.microbatches)
    per_layer = s * b * h * (10 + 24 / par.tp + 5 * a * s / (h * par.tp))
    if par.sequence_parallel:
        per_layer = s * b * h * (34 + 5 * a * s / h) / par.tp
    if train.precision == "fp32":
        per_layer *= 2
    # Context parallelism keeps 1/cp of each sequence's tokens per rank (its ring kernel keeps no
    # score matrix, only a log-sum-exp per query: the score term is an upper bound there).
    per_layer /= par.cp
    if train.activation_checkpointing:
        per_layer = 2 * s * b * h * (1 if train.precision == "bf16" else 2) / par.cp  # each block's input only
    layers_per_stage = model.num_layers / par.pp
    # 1F1B keeps up to pp microbatches in flight on the first stage; GPipe keeps all of them.
    in_flight = par.microbatches if par.schedule == "gpipe" else min(par.pp, par.microbatches)
    return per_layer * layers_per_stage * in_flight


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
    skeleton = build_model(config.model, layers=())  # the meta device: shapes only
    shapes = {n: p.shape for n, p in skeleton.named_parameters()}
    costs = layer_costs(shapes, tied_names(config.model))  # a tied head holds its copy of the embedding
    schedule = make_schedule(par.schedule, par.pp, par.microbatches, par.virtual_stages)
    lines.append(f"pipeline ({par.schedule}, {par.microbatches} microbatches; layer 0 embeds, the last is the head):")
    per_pp_rank: dict[int, int] = {}
    for stage, layers in enumerate(pipeline_bounds(config, shapes)):
        count = sum(costs[i] for i in layers)
        per_pp_rank[schedule.rank_of(stage)] = per_pp_rank.get(schedule.rank_of(stage), 0) + count
        lines.append(
            f"  stage {stage} on pp rank {schedule.rank_of(stage)}: layers {layers.start}-{layers.stop - 1} "
            f"({count:,} parameters)"
        )
    num_params = parameter_count(config)
    bounds = pipeline_bounds(config, shapes)
    owner = {i: schedule.rank_of(stage) for stage, layers in enumerate(bounds) for i in layers}
    for alias, name in tied_names(config.model).items():
        first, last = int(name.split(".")[1]), int(alias.split(".")[1])
        if owner[first] == owner[last]:  # one pipeline rank holds both: one tensor, not a copy
            per_pp_rank[owner[last]] -= math.prod(shapes[name])
    heaviest = max(per_pp_rank.values())  # pipeline ranks hold unequal shares; the largest sets the need
    states = model_state_bytes_per_rank(config, heaviest)
    acts = activation_bytes_per_rank(config)
    lines += [
        f"model: {config.model.kind}, {num_params:,} parameters; the heaviest pipeline rank holds {heaviest:,}",
        f"memory per rank (estimate): model states {states / 2**20:,.1f} MiB "
        f"(ZeRO-{par.zero_stage}, {config.training.precision}), activations {acts / 2**20:,.1f} MiB, "
        f"total {(states + acts) / 2**20:,.1f} MiB",
    ]
    return "\n".join(lines)
