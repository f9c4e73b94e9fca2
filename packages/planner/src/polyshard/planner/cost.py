"""Step time of a layout: compute from FLOPs, collectives from their volume, bubbles from the simulator.

Per microbatch on a stage (t tokens on this rank; P the matmul parameters a token passes through,
÷ tp; experts count top_k / num_experts of theirs; A the attention's FLOPs per token, ÷ tp: both are
:func:`polyshard.models.flops.layer_flops`, the count MFU uses too)::

    forward   F = 2·t·P / rate  +  t·A / rate (causal: half the scores)
                  +  saved bytes / elementwise bandwidth ÷ 3  +  its forward collectives
    backward  B = the input gradients (as F's matmuls, attention twice) + 2/3 of the elementwise work
                  + backward collectives (+ F again under activation checkpointing)
    weight    W = the weight gradients: F's matmuls without attention

``rate`` is the profile's matmul rate at the layer's width with this many processes on a node. The
pipeline simulator runs the layout's schedule with these costs and the point-to-point time of one
activation; after it, the per-step collectives (data-parallel gradients, of which ``overlap`` of
the last backward hides, ZeRO's parameter gathers, the loop's scalars), the gradient clip's pass and
the AdamW step add up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from polyshard.collectives.ledger import bus_factor
from polyshard.dp import ShardSpec
from polyshard.models import sequence_length
from polyshard.models.flops import layer_flops
from polyshard.planner.activations import micro_batch_size, stage_bytes
from polyshard.planner.comm import Traffic, boundary_bytes, microbatch_traffic, step_traffic
from polyshard.planner.model_states import Held, holdings, stage_bounds
from polyshard.planner.pipeline import PipelineCosts, stages_by_rank, step_time
from polyshard.planner.profile import Profile
from polyshard.trainer.config import Config, ParallelConfig


@dataclass(frozen=True)
class StageCosts:
    forward: float
    backward: float
    weight: float


def stage_flops(config: Config, layers: range) -> tuple[float, float]:
    """Forward FLOPs of one microbatch on one rank of the stage holding pipeline ``layers``: (matmuls,
    attention), each ÷ tp, over this rank's tokens (÷ cp: each cp rank's queries see the whole sequence)."""
    par = config.parallel
    tokens = micro_batch_size(config) * sequence_length(config.model) / par.cp
    flops = layer_flops(config.model)
    matmul = tokens * sum(flops[i].matmul for i in layers) / par.tp
    attention = tokens * sum(flops[i].attention for i in layers) / par.tp
    return matmul, attention


def processes_per_node(parallel: ParallelConfig, profile: Profile) -> int:
    return min(parallel.world_size, profile.devices_per_node)


def call_s(t: Traffic, parallel: ParallelConfig, profile: Profile) -> float:
    """Seconds of one call of ``t`` on this layout's placement."""
    factor = 1.0 if t.op == "p2p" else bus_factor(t.op, t.group)
    inter = crosses_nodes(t.axis, parallel, profile)
    return profile.collective_s(
        t.op, t.group, t.nbytes, factor, inter=inter, processes=processes_per_node(parallel, profile)
    )


def _phase_s(traffic: list[Traffic], parallel: ParallelConfig, profile: Profile, phase: str) -> float:
    return sum(t.calls * call_s(t, parallel, profile) for t in traffic if t.phase == phase)


DATA_AXES = ("dp", "dp_shard", "dp_replicate")
"""Traffic axes of the gradient reduction and ZeRO's gathers (see :class:`~polyshard.planner.comm.Traffic`)."""


def crosses_nodes(axis: str, parallel: ParallelConfig, profile: Profile) -> bool:
    """Whether a group of ``axis`` spans nodes: ranks are laid out pp, dp, ep, cp, tp (tp fastest; hybrid
    sharding splits dp into dp_replicate, dp_shard), so a group's ranks are ``stride`` apart, stride the
    product of the faster axes. A shard group that fits in a node keeps ZeRO's traffic there; only
    the replicas' all-reduce (1/dp_shard of the gradients) crosses nodes."""
    sizes = parallel.mesh_axes
    order = list(sizes)
    if axis == "world":
        return parallel.world_size > profile.devices_per_node
    if axis in ("cp_ulysses", "cp_ring"):  # the 2-D scheme's parts of cp: Ulysses groups are neighbouring cp ranks
        inner = parallel.cp_ulysses or parallel.cp
        stride = math.prod(sizes[a] for a in order[order.index("cp") + 1 :])
        return stride * (inner if axis == "cp_ulysses" else parallel.cp) > profile.devices_per_node
    groups = {"dp": ("dp_replicate", "dp_shard", "ep", "cp") if parallel.hybrid else parallel.replica_axes}
    groups |= {"dp_shard": parallel.shard_axes, "dp_replicate": parallel.replicate_axes}
    axes = list(groups.get(axis, (axis,)))
    fastest = max(order.index(a) for a in axes)
    stride = math.prod(sizes[a] for a in order[fastest + 1 :])
    span = stride * math.prod(sizes[a] for a in axes)
    return span > profile.devices_per_node


def stage_costs(
    config: Config, layers: range, profile: Profile, gathers: tuple[float, float] = (0.0, 0.0)
) -> StageCosts:
    """``gathers``: seconds of ZeRO-3's parameter traffic in this stage's forward and backward, of which
    the profile's ``overlap`` share of the compute hides some (prefetching the next block's)."""
    model, par = config.model, config.parallel
    micro_batch = micro_batch_size(config)
    k = processes_per_node(par, profile)
    width = math.sqrt(model.hidden * model.mlp_width / par.tp) / 2  # the calibration's (h, 4h) at tp = 1
    rate = profile.matmul_flops(width, k)
    matmul_flops, attention_flops = stage_flops(config, layers)
    matmul, attention = matmul_flops / rate, attention_flops / rate
    blocks = sum(1 for i in layers if 0 < i < model.num_layers + 1)
    touched = stage_bytes(config, layers, micro_batch, checkpointing=False)  # what runs, saved or not
    elementwise = touched / profile.elementwise_bandwidth(width, k)
    elementwise += blocks * profile.block_overhead(width, k)
    traffic = microbatch_traffic(config, layers, micro_batch)
    forward = matmul + attention + elementwise / 3
    recompute = _recompute_s(config.training.activation_checkpointing, forward, elementwise / 3, attention, par.cp)
    backward = matmul + 2 * attention + 2 * elementwise / 3 + recompute
    forward += max(0.0, gathers[0] - profile.overlap * forward) + _phase_s(traffic, par, profile, "forward")
    backward += max(0.0, gathers[1] - profile.overlap * (backward + matmul))
    backward += _phase_s(traffic, par, profile, "backward")
    return StageCosts(forward, backward, matmul)


def _recompute_s(mode: bool | str, forward: float, elementwise: float, attention: float, cp: int) -> float:
    """The forward work activation checkpointing repeats in backward: all of it ("full"), or ("selective")
    the elementwise work between the kept matmuls, plus attention where the kernel is not kept (cp's ring)."""
    if mode == "selective":
        return elementwise + (attention if cp > 1 else 0.0)
    return forward if mode else 0.0


@dataclass(frozen=True)
class StepEstimate:
    step_s: float
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds by part: pipeline (compute, in-stage collectives, transfers, bubbles), dp, optimizer, other."""


def estimate_step(config: Config, profile: Profile, exact: bool = True) -> StepEstimate:
    """Seconds per optimizer step of ``config``'s layout on ``profile``'s machine (not ``exact``: the
    pipeline from the unit-cost simulation scaled, to screen many layouts quickly)."""
    par = config.parallel
    bounds = stage_bounds(config)
    placement = stages_by_rank(par.schedule, par.pp, par.virtual_stages)
    per_rank = [step_traffic(config, rank) for rank in range(par.pp)]
    # ZeRO-3 gathers and reduces every microbatch: (forward, backward) seconds, shared by the rank's stages.
    gathers: dict[int, tuple[float, float]] = {}
    for rank, traffic in enumerate(per_rank):
        stages = placement[rank]
        for s in stages:
            gathers[s] = (
                _phase_s(traffic, par, profile, "forward") / len(stages),
                _phase_s(traffic, par, profile, "backward") / len(stages),
            )
    costs = [stage_costs(config, bounds[s], profile, gathers[s]) for s in range(len(bounds))]
    micro_batch = micro_batch_size(config)
    transfer = Traffic("pp", "p2p", 2, boundary_bytes(config, micro_batch), 1, "forward")
    pipe = PipelineCosts(
        forward=tuple(c.forward for c in costs),
        backward=tuple(c.backward for c in costs),
        weight=tuple(c.weight for c in costs),
        p2p=call_s(transfer, par, profile) if par.pp > 1 else 0.0,
    )
    pipeline = step_time(par.schedule, par.pp, par.microbatches, par.virtual_stages, pipe, exact)
    k = processes_per_node(par, profile)
    slowest: dict[str, float] = {}
    for rank in range(par.pp):  # after the pipeline, the slowest pipeline rank sets the step's end
        traffic = [t for t in per_rank[rank] if t.phase == "step"]
        reduce = sum(call_s(t, par, profile) for t in traffic if t.axis in DATA_AXES and t.op != "all_gather")
        gather = sum(call_s(t, par, profile) for t in traffic if t.axis in DATA_AXES and t.op == "all_gather")
        other = sum(t.calls * call_s(t, par, profile) for t in traffic if t.axis not in DATA_AXES)
        last_backward = max(costs[s].backward + costs[s].weight for s in placement[rank])
        dp = max(0.0, reduce - profile.overlap * last_backward) + gather  # ZeRO's gather follows the step
        held = holdings(config, rank)
        elements = sum(count * _stepped(h, par.zero_stage) for h, count in held.items())
        tensors = sum(count for h, count in held.items() if h.frozen_bytes is None)
        # AdamW, and before it the global-norm clip: one more pass reading every gradient, tensor by tensor.
        optimizer = profile.optimizer_s(elements, tensors, k) + profile.optimizer_s(elements, tensors, k, 4)
        parts = {"dp": dp, "optimizer": optimizer, "other": other}
        if sum(parts.values()) > sum(slowest.values(), -1.0):
            slowest = parts
    return StepEstimate(pipeline + sum(slowest.values()), {"pipeline": pipeline, **slowest})


def _stepped(held: Held, zero_stage: int) -> float:
    """Elements of one parameter this rank's optimizer steps (its ZeRO rows, or all of it; none if frozen)."""
    if held.frozen_bytes is not None:
        return 0
    return ShardSpec(held.shape, held.shard_ranks).shard_numel if zero_stage >= 1 else math.prod(held.shape)
