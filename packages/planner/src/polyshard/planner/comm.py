"""Communication per step: every collective a rank runs, on which axis, how large, how often.

A :class:`Traffic` is one kind of call: ``nbytes`` is the buffer as nccl-tests sizes it (the
all-gather output, the reduce-scatter input), and its wire bytes use the ring bus factor of
:func:`polyshard.collectives.ledger.bus_factor`. Per microbatch on a stage holding ``L`` blocks
(``b`` examples of ``s`` positions, hidden ``h``, ``e`` bytes per activation)::

    tp   per block 4 all-reduces of b·s·h·e (2 forward, 2 backward; Megatron-LM 1909.08053), or with
         sequence parallelism 4 all-gathers + 4 reduce-scatters of it; +2 (+2+2) when checkpointing
         recomputes the forward; the vocabulary-parallel embedding 1, its head 1 and the loss 3 small
    ep   per MoE block 4 all-to-alls of b·s·top_k·h·e (dispatch and combine, forward and backward);
         under cp each rank's b·s/cp tokens, and per MoE block one all-reduce over cp of the router's
         2E+2 fp32 statistics forward and one backward (polyshard.models.common.moe.token_group); with a capacity
         factor, all-gathers of the b·s·top_k int64 expert choices and the s int64 positions
    cp   per block (ring): K and V packed, cp-1 hops forward, cp-1 again backward plus cp hops of fp32
         dK/dV; (all-gather style) K and V gathered forward, fp32 dK and dV reduce-scattered backward;
         (ulysses) 4 all-to-alls of Q, K, V and the output forward, 4 of their gradients backward, each
         sending (cp-1)/cp of its buffer; (ulysses+ring) those over cp_ulysses ranks (axis cp_ulysses)
         and the ring's over the cp / cp_ulysses ranks of axis cp_ring, with the kv heads of N/cp_ulysses
    pp   one activation forward and one gradient backward per stage boundary (÷ tp under SP)
    dp   ZeRO-3: all-gather every parameter in forward and again in backward, reduce-scatter grads

and once per step: gradients over the replicas dp x ep x cp, experts' over dp x cp (an fp32 all-reduce
at ZeRO-0; a reduce-scatter plus the parameters' all-gather at ZeRO-1/2; ZeRO-3's were per microbatch).
Hybrid sharding (``dp_shard``) moves the reduce-scatter and the gathers onto the shard group (axis
``dp_shard``: dp_shard x ep x cp, experts dp_shard x cp) and adds, after each reduce-scatter, an
all-reduce of this rank's row (its 1/n of the gradients and their flags) across the replicas (axis
``dp_replicate``). Then the tied embedding's all-reduce between the pipeline's ends, the loop's two
scalar all-reduces, with ``optimizer.idle_experts = "skip"`` the rows each local expert took over
dp x cp (which stayed idle, engine.experts), every layer's load and bias over the world (engine.balance), and
for a language model the count of target tokens over the replicas (the loss divides by it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

from polyshard.collectives.ledger import bus_factor
from polyshard.dp import ShardSpec
from polyshard.models import sequence_length, spec_of, tied_names
from polyshard.models.decoder import moe_config
from polyshard.planner.activations import micro_batch_size
from polyshard.planner.model_states import Held, gathered_once, holdings, stage_bounds, tied_copy_elements
from polyshard.planner.pipeline import stages_by_rank
from polyshard.trainer.config import Config
from polyshard.trainer.tasks import LANGUAGE, task_of


@dataclass(frozen=True)
class Traffic:
    axis: str
    """tp, pp, dp (the replica group dp x ep x cp), ep, cp or world; under hybrid sharding also dp_shard
    (ZeRO's shard group, dp_shard x ep x cp) and dp_replicate (the shard's copies); under cp_style
    'ulysses+ring' cp_ulysses (neighbouring cp ranks) and cp_ring (the cp ranks of one Ulysses index)."""
    op: str
    """all_reduce, all_gather, reduce_scatter, all_to_all or p2p."""
    group: int
    """Ranks in the group."""
    nbytes: float
    """Buffer bytes per call."""
    calls: float
    """Calls per microbatch (phase forward/backward) or per step (phase step)."""
    phase: str
    """forward or backward (inside the pipeline's compute actions) or step (after it)."""

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends for all the calls."""
        return self.nbytes * bus_factor(self.op, self.group) * self.calls


def _activation(config: Config, micro_batch: int) -> float:
    e = 2 if config.training.precision == "bf16" else 4
    return micro_batch * sequence_length(config.model) * config.model.hidden * e / config.parallel.cp


def _tp_regions(config: Config, layer: int) -> int:
    """The tp regions of block ``layer``: its attention, and its MLP where tp splits one (a dense MLP or an
    MoE block's shared experts; the routed experts are ep's and take no tp collective)."""
    model = config.model
    if not spec_of(model).has_experts:
        return 2
    moe = moe_config(model)
    return 1 + int(not moe.sparse_layer(layer - 1) or moe.moe.shared_experts > 0)


def _tp(config: Config, layers: range, act: float) -> list[Traffic]:
    t, last, sp = config.parallel.tp, config.model.num_layers + 1, config.parallel.sequence_parallel
    if t == 1:
        return []
    regions = sum(_tp_regions(config, i) for i in layers if 0 < i < last)
    recompute = regions if config.training.activation_checkpointing else 0
    if sp:  # each all-reduce becomes an all-gather and a reduce-scatter
        out = [Traffic("tp", op, t, act, regions, "forward") for op in ("all_gather", "reduce_scatter")]
        out += [Traffic("tp", op, t, act, regions + recompute, "backward") for op in ("all_gather", "reduce_scatter")]
    else:
        out = [Traffic("tp", "all_reduce", t, act, regions, "forward")]
        out += [Traffic("tp", "all_reduce", t, act, regions + recompute, "backward")]
    if 0 in layers:  # the vocabulary-parallel embedding sums its rows; SP's first split gathers back
        out.append(Traffic("tp", "all_reduce", t, act, 1, "forward"))
        out += [Traffic("tp", "all_gather", t, act, 1, "backward")] if sp else []
    if last in layers:  # the head's input: copied in (all-reduce backward), or gathered under SP
        out += [Traffic("tp", "all_gather", t, act, 1, "forward")] if sp else []
        out.append(Traffic("tp", "reduce_scatter" if sp else "all_reduce", t, act, 1, "backward"))
        tokens = act / config.model.hidden / (2 if config.training.precision == "bf16" else 4)
        out.append(Traffic("tp", "all_reduce", t, 4 * tokens, 3, "forward"))  # loss: max, sum exp, target logit
    return out


def _ep_cp(config: Config, layers: range, act: float) -> list[Traffic]:
    model, par, last = config.model, config.parallel, config.model.num_layers + 1
    has_experts = spec_of(model).has_experts
    out: list[Traffic] = []
    blocks = sum(1 for i in layers if 0 < i < last)
    # Blocks with experts (an MoE model's dense_layers have none): the all-to-alls and aux statistics.
    sparse = sum(1 for i in layers if 0 < i < last and moe_config(model).sparse_layer(i - 1)) if has_experts else 0
    # Under sequence parallelism each tp rank routes its sequence shard, and the token group spans tp too.
    shard = par.tp if par.sequence_parallel else 1
    group = par.cp * shard
    axis = "cp" if par.cp > 1 else "tp"  # the token group's slowest axis
    if par.ep > 1 and has_experts:
        routed = act / shard * moe_config(model).moe.top_k
        out += [Traffic("ep", "all_to_all", par.ep, routed, 2 * sparse, p) for p in ("forward", "backward")]
    if group > 1 and has_experts:  # the aux losses' per-expert statistics, summed over the token group
        moe = moe_config(model).moe
        stats = 4 * (2 * moe.num_experts + 2)  # fp32: assignments, probabilities (E each), z sum, tokens
        recompute = sparse if config.training.activation_checkpointing == "full" else 0  # the MoE forward reruns
        out.append(Traffic(axis, "all_reduce", group, stats, sparse, "forward"))
        out.append(Traffic(axis, "all_reduce", group, stats, sparse + recompute, "backward"))
        if moe.capacity_factor is not None:  # the capacity rule's int64 expert choices and positions, gathered
            tokens = act / shard / model.hidden / (2 if config.training.precision == "bf16" else 4)  # this rank's
            for nbytes in (8 * group * tokens * moe.top_k, 8 * sequence_length(model)):
                out.append(Traffic(axis, "all_gather", group, nbytes, sparse, "forward"))
                out += [Traffic(axis, "all_gather", group, nbytes, recompute, "backward")] if recompute else []
    if par.cp > 1:
        out += _cp(config, blocks, act)
    return out


def _cp(config: Config, blocks: int, act: float) -> list[Traffic]:
    """Context parallelism's traffic per microbatch (``act``: this rank's b·s/cp·h·e). The ring
    (polyshard.cp.ring) sends K and V packed, cp-1 hops forward; backward re-sends them cp-1 hops and
    passes the fp32 dK/dV partial sums cp hops. The all-gather style gathers K and V in forward and
    reduce-scatters their fp32 gradients in backward. Ulysses (polyshard.cp.ulysses) all-to-alls Q, K,
    V (K and V repeated where the group outnumbers the kv heads) and the output forward, their
    gradients backward; the 2-D scheme does that over its cp_ulysses group and rings the K/V its heads
    need over the cp / cp_ulysses ranks of axis cp_ring."""
    model, par = config.model, config.parallel
    tp, cp, style = par.tp, par.cp, par.cp_style
    e = 2 if config.training.precision == "bf16" else 4
    kv_heads = model.kv_heads // tp if model.kv_heads % tp == 0 else 1  # replicated past kv heads
    tokens = act / (model.hidden * e)  # this rank's b·s/cp
    chunk = tokens * kv_heads * model.attention_head_dim * e  # this rank's K (or V): its tokens x its kv heads
    if style in ("ulysses", "ulysses+ring"):
        ulysses = cp if style == "ulysses" else par.cp_ulysses or 1
        axis = "cp" if style == "ulysses" else "cp_ulysses"
        chunk *= max(1, ulysses // kv_heads)  # each kv head repeated for the ranks beyond the kv heads
        query = tokens * model.num_heads // tp * model.attention_head_dim * e  # Q, and the output alike
        forward = [Traffic(axis, "all_to_all", ulysses, nbytes, blocks, "forward") for nbytes in (query, query)]
        forward += [Traffic(axis, "all_to_all", ulysses, chunk, 2 * blocks, "forward")]
        backward = [dataclasses.replace(t, phase="backward") for t in forward]
        if style == "ulysses+ring":
            ring = cp // ulysses
            forward.append(Traffic("cp_ring", "p2p", ring, 2 * chunk, (ring - 1) * blocks, "forward"))
            backward.append(dataclasses.replace(forward[-1], phase="backward"))
            backward.append(Traffic("cp_ring", "p2p", ring, 8 * chunk / e, ring * blocks, "backward"))
    elif style == "ring":
        forward = [Traffic("cp", "p2p", cp, 2 * chunk, (cp - 1) * blocks, "forward")]
        backward = [
            dataclasses.replace(forward[0], phase="backward"),
            Traffic("cp", "p2p", cp, 8 * chunk / e, cp * blocks, "backward"),
        ]
    else:
        forward = [Traffic("cp", "all_gather", cp, chunk * cp, 2 * blocks, "forward")]
        backward = [Traffic("cp", "reduce_scatter", cp, chunk * cp * 4 / e, 2 * blocks, "backward")]
    if config.training.activation_checkpointing:  # the recomputed forward moves K and V again
        backward += [dataclasses.replace(t, phase="backward") for t in forward]
    return forward + backward


def microbatch_traffic(config: Config, layers: range, micro_batch: int) -> list[Traffic]:
    """What one microbatch's forward and backward on the stage holding ``layers`` communicate."""
    act = _activation(config, micro_batch)
    return _tp(config, layers, act) + _ep_cp(config, layers, act)


def boundary_bytes(config: Config, micro_batch: int) -> float:
    """Bytes of one activation (or its gradient) sent between two pipeline stages."""
    par = config.parallel
    shard = par.tp if par.sequence_parallel else 1
    return _activation(config, micro_batch) / shard


def _gradient_traffic(config: Config, pp_rank: int) -> list[Traffic]:
    """Gradient reduction and ZeRO's parameter gathers, grouped by replica group size."""
    par, precision = config.parallel, config.training.precision
    weight = 2 if precision == "bf16" else 4
    # (replicas, shard group) -> elements + flags at stage 0, ZeRO's padded rows, flags, ZeRO-3's gathered bytes
    sizes: dict[tuple[int, int], list[float]] = {}
    for held, count in holdings(config, pp_rank).items():
        if held.replicas > 1:
            n = held.shard_ranks
            entry = sizes.setdefault((held.replicas, n), [0.0, 0.0, 0.0, 0.0])
            rows = count * n * ShardSpec(held.shape, n).shard_numel
            entry[3] += rows * (weight if held.frozen_bytes is None else held.frozen_bytes)
            if held.frozen_bytes is not None:
                continue  # LoRA's frozen base: gathered under ZeRO-3, never reduced
            entry[0] += count * (math.prod(held.shape) + 1)
            entry[1] += rows
            entry[2] += count * n
    once: dict[tuple[int, int], float] = {}  # bytes of ZeRO-3's rows gathered once a microbatch (gathered_once)
    if par.zero_stage == 3:
        for held, count in gathered_once(config, pp_rank).items():
            if held.replicas > 1:
                key = (held.replicas, held.shard_ranks)
                element = weight if held.frozen_bytes is None else held.frozen_bytes
                once[key] = once.get(key, 0.0) + element * count * key[1] * ShardSpec(held.shape, key[1]).shard_numel
    out = []
    for (replicas, n), (whole, padded, flags, gathered) in sizes.items():
        copies = replicas // n  # hybrid sharding's replicas of each shard (1 without it)
        shard_axis = "dp_shard" if copies > 1 else "dp"
        reduce_phase = "backward" if par.zero_stage == 3 else "step"
        if not flags:  # only frozen parameters in this group: ZeRO-3's gathers, nothing to reduce
            if par.zero_stage == 3:
                out.append(Traffic(shard_axis, "all_gather", n, gathered, 1, "forward"))
                out.append(Traffic(shard_axis, "all_gather", n, gathered - once.get((replicas, n), 0.0), 1, "backward"))
            continue
        if par.zero_stage == 0:
            out.append(Traffic("dp", "all_reduce", n, 4 * whole, 1, "step"))
        elif par.zero_stage in (1, 2):
            out.append(Traffic(shard_axis, "reduce_scatter", n, 4 * (padded + flags), 1, "step"))
            out.append(Traffic(shard_axis, "all_gather", n, weight * padded, 1, "step"))
        else:  # gathered before each forward and again before each backward, but once for some
            again = gathered - once.get((replicas, n), 0.0)
            out.append(Traffic(shard_axis, "all_gather", n, gathered, 1, "forward"))
            out.append(Traffic(shard_axis, "all_gather", n, again, 1, "backward"))
            out.append(Traffic(shard_axis, "reduce_scatter", n, 4 * (padded + flags), 1, "backward"))
        if copies > 1:  # each rank's reduced row (1/n of the buffer, flags included) summed over the copies
            out.append(Traffic("dp_replicate", "all_reduce", copies, 4 * (padded + flags) / n, 1, reduce_phase))
    return out


def _zero_rows(held: Held) -> int:
    """The rows of ``held`` a rank keeps under ZeRO: its padded shard, or the whole tensor when not replicated."""
    return ShardSpec(held.shape, held.shard_ranks).shard_numel if held.replicas > 1 else math.prod(held.shape)


def step_traffic(config: Config, pp_rank: int) -> list[Traffic]:
    """Per-step collectives of pipeline rank ``pp_rank`` (ZeRO-3's gathers are per microbatch)."""
    par, model = config.parallel, config.model
    out = _gradient_traffic(config, pp_rank)
    if tied_names(model) and par.pp > 1 and pp_rank in (0, par.pp - 1):
        out += [Traffic("pp", "all_reduce", 2, 4 * elements, 1, "step") for elements in tied_copy_elements(config)]
    if par.sequence_parallel and par.tp > 1:  # norms and experts on sequence shards: their grads sum over tp
        # as the optimizer reads them: whole at stage 0, this rank's ZeRO rows (padded) at stages 1-3
        norms = sum(
            c * (_zero_rows(h) if par.zero_stage else math.prod(h.shape))
            for h, c in holdings(config, pp_rank).items()
            if h.frozen_bytes is None and ((len(h.shape) == 1 and not h.tp_sharded) or h.sequence_summed)
        )
        out.append(Traffic("tp", "all_reduce", par.tp, 4 * norms, 1, "step"))
    expert_replicas = par.dp * par.cp
    skips_idle = config.optimizer.idle_experts == "skip"  # which experts were idle: rows per local expert (int64)
    if spec_of(model).has_experts and expert_replicas > 1 and skips_idle:
        bounds, stages = stage_bounds(config), stages_by_rank(par.schedule, par.pp, par.virtual_stages)[pp_rank]
        moe = moe_config(model)
        blocks = sum(1 for s in stages for i in bounds[s] if 0 < i <= model.num_layers and moe.sparse_layer(i - 1))
        rows = 8 * blocks * moe.moe.num_experts // par.ep
        out.append(Traffic("dp", "all_reduce", expert_replicas, rows, 1, "step"))
    out.append(Traffic("world", "all_reduce", par.world_size, 8, 2, "step"))  # loss, gradient norm
    if spec_of(model).has_experts and par.world_size > 1:  # every layer's load and bias (engine.balance), fp64
        pipeline_layers = model.num_layers + 2  # the embedding, the blocks, the head
        out.append(
            Traffic(
                "world",
                "all_reduce",
                par.world_size,
                8 * pipeline_layers * (2 * moe_config(model).moe.num_experts + 2),
                1,
                "step",
            )
        )
    if task_of(model) is LANGUAGE and par.replicas > 1:  # the global batch's target-token count (fp64)
        out.append(Traffic("dp", "all_reduce", par.replicas, 8, 1, "step"))
    return out


def rank_traffic(config: Config, pp_rank: int) -> list[Traffic]:
    """Everything pipeline rank ``pp_rank`` communicates in a step: each of its stages' microbatch
    traffic, its sends to neighbouring stages, and the per-step collectives."""
    par = config.parallel
    micro_batch = micro_batch_size(config)
    bounds = stage_bounds(config)
    placement = stages_by_rank(par.schedule, par.pp, par.virtual_stages)
    stages = placement[pp_rank]
    out = [t for s in stages for t in microbatch_traffic(config, bounds[s], micro_batch)]
    last = par.pp * par.virtual_stages - 1
    act = boundary_bytes(config, micro_batch)
    if par.pp > 1:
        out.append(Traffic("pp", "p2p", 2, act, sum(1 for s in stages if s < last), "forward"))
        out.append(Traffic("pp", "p2p", 2, act, sum(1 for s in stages if s > 0), "backward"))
    return out + step_traffic(config, pp_rank)


def bytes_per_axis(traffic: Iterable[Traffic], microbatches: int) -> dict[str, float]:
    """Wire bytes per step by axis (per-microbatch traffic counted ``microbatches`` times)."""
    out: dict[str, float] = {}
    for t in traffic:
        times = 1 if t.phase == "step" else microbatches
        out[t.axis] = out.get(t.axis, 0.0) + t.wire_bytes * times
    return out
