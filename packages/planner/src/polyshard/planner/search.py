"""Enumerate the layouts of a model on N devices, keep those that fit, rank them by estimated step time.

For every mesh dp x tp x pp x ep (x cp, where polyshard has it) of the devices, every ZeRO stage,
microbatch count, pipeline schedule, sequence parallelism and activation checkpointing: the
heaviest rank's memory (model states to the byte, activations from the simulator's in-flight
count) decides whether it fits; the cost model estimates the step of those that do. The trainer's
own checks (:func:`polyshard.trainer.engine.constraints.validate`) reject what polyshard cannot run.
tp stays inside a node and a pipeline has at most one stage per layer. Activation
checkpointing is only tried where the layout does not fit without it (it never makes a step
faster). Every fitting layout is screened with the unit-cost simulation scaled by its costs; the
best :data:`SIMULATED` are simulated with their own costs and ranked by that.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from polyshard.mesh import divisors
from polyshard.models import sequence_length, spec_of
from polyshard.models.decoder import moe_config
from polyshard.planner.activations import activation_bytes
from polyshard.planner.comm import bytes_per_axis, rank_traffic
from polyshard.planner.cost import StepEstimate, estimate_step
from polyshard.planner.model_states import ModelStates, rank_model_states
from polyshard.planner.profile import Profile
from polyshard.trainer.config import RECOMPUTE, V_SCHEDULES, Config, ParallelConfig
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError

SCHEDULES = ("1f1b", "zb-h1", "gpipe", "interleaved", "zb-v", "dualpipev")
MIN_CONTEXT_TOKENS = 4096
"""Context parallelism is weighed only while each rank keeps at least this many of a sequence's tokens:
below it the ring's K/V transfers hide less and less behind the block's compute (Llama 3 used cp 16 at 128K
tokens, 8K per rank). A cp the user fixes is always weighed."""
SIMULATED = 32
"""Layouts simulated with their own costs after the screen."""
CHOSEN = (
    "dp",
    "dp_shard",
    "tp",
    "pp",
    "ep",
    "cp",
    "cp_style",
    "cp_ulysses",
    "zero_stage",
    "microbatches",
    "schedule",
    "virtual_stages",
    "sequence_parallel",
)
"""The fields of a config's ``parallel`` section the search chooses (with ``training.activation_checkpointing``);
the rest of the section (timeout_s, a stage split that still fits) is kept."""


def choices(config: Config) -> dict[str, object]:
    """What the search chose for ``config``: its :data:`CHOSEN` parallel fields and activation checkpointing."""
    chosen: dict[str, object] = {name: getattr(config.parallel, name) for name in CHOSEN}
    return {**chosen, "activation_checkpointing": config.training.activation_checkpointing}


def label(config: Config) -> str:
    """``dp2 tp2 pp2 1f1b m4 z1``: the mesh axes above 1, then the rest of the layout that matters."""
    par = config.parallel
    axes = " ".join(f"{a}{n}" for a, n in par.mesh_axes.items() if n > 1) or "1 rank"
    parts = [axes]
    if par.pp > 1:
        parts.append(par.schedule + (f" v{par.virtual_stages}" if par.virtual_stages > 1 else ""))
    parts.append(f"m{par.microbatches}")
    parts.append(f"z{par.zero_stage}")
    if par.sequence_parallel:
        parts.append("sp")
    if config.training.activation_checkpointing:
        parts.append("sac" if config.training.activation_checkpointing == "selective" else "ac")
    return " ".join(parts)


@dataclass(frozen=True)
class Request:
    devices: int
    """Processes (devices) to lay out."""
    devices_per_node: int
    memory_gb: float
    """Memory per device, GB (1e9 bytes)."""
    fixed: Mapping[str, object] = field(default_factory=dict)
    """Fields the user fixed: of :data:`CHOSEN` (tp=8, zero_stage=1, schedule='1f1b', ...), or
    activation_checkpointing."""


@dataclass(frozen=True)
class Memory:
    """The heaviest rank's bytes."""

    states: ModelStates
    activations: float

    @property
    def total(self) -> float:
        return self.states.total + self.activations

    def as_gb(self) -> dict[str, float]:
        s = self.states
        parts = {"params": s.params, "grads": s.grads, "optimizer": s.optimizer, "activations": self.activations}
        return {k: v / 1e9 for k, v in {**parts, "total": self.total}.items()}


@dataclass(frozen=True)
class Candidate:
    config: Config
    """The searched config laid out: its ``parallel`` section and ``training.activation_checkpointing`` are this
    candidate's layout."""
    memory: Memory
    comm_bytes: dict[str, float]
    step: StepEstimate | None = None

    @property
    def step_s(self) -> float:
        return self.step.step_s if self.step else float("inf")

    def as_dict(self) -> dict[str, object]:
        return {
            "layout": choices(self.config),
            "label": label(self.config),
            "per_rank_gb": self.memory.as_gb(),
            "comm_bytes": self.comm_bytes,
            "step_s": self.step_s,
            "step_parts_s": self.step.parts if self.step else {},
        }


def memory_of(config: Config) -> Memory:
    """The heaviest pipeline rank's model states and activations (every dp/tp/ep rank of it holds alike)."""
    ranks = [(rank_model_states(config, r), activation_bytes(config, r)) for r in range(config.parallel.pp)]
    states, acts = max(ranks, key=lambda pair: pair[0].total + pair[1])
    return Memory(states, acts)


def comm_of(config: Config) -> dict[str, float]:
    """Wire bytes per step by axis, of the pipeline rank that sends the most."""
    per_rank = [
        bytes_per_axis(rank_traffic(config, r), config.parallel.microbatches) for r in range(config.parallel.pp)
    ]
    return max(per_rank, key=lambda axes: sum(axes.values()))


def meshes(config: Config, request: Request) -> Iterator[dict[str, int]]:
    """Every dp x tp x pp x ep x cp of the devices that the model's shape allows (tp splits the query
    heads and either splits the kv heads or replicates each on tp / kv ranks; cp cuts each sequence
    into 2·cp chunks, for a family whose attention polyshard.cp can split)."""
    model, n = config.model, request.devices
    spec = spec_of(model)
    context = spec.context_parallel and model.dropout == 0
    for tp in divisors(n):
        mlp = moe_config(model).shared_width if spec.has_experts else model.mlp_width  # what tp splits of the MLP
        if tp > request.devices_per_node or model.num_heads % tp or mlp % tp:
            continue
        if model.kv_heads % tp and tp % model.kv_heads:
            continue
        for cp in divisors(n // tp) if context else [1]:
            if "cp" in request.fixed:
                if cp != request.fixed["cp"]:
                    continue
            elif cp > 1 and (sequence_length(model) % (2 * cp) or sequence_length(model) // cp < MIN_CONTEXT_TOKENS):
                continue
            for ep in divisors(n // (tp * cp)) if spec.has_experts else [1]:
                if spec.has_experts and moe_config(model).moe.num_experts % ep:
                    continue
                for pp in divisors(n // (tp * cp * ep)):
                    if pp <= model.num_layers + 2:  # Megatron's 530B ran pp 35, its 1T pp 64
                        yield {"dp": n // (tp * cp * ep * pp), "tp": tp, "pp": pp, "ep": ep, "cp": cp}


def layouts(config: Config, request: Request) -> Iterator[ParallelConfig]:
    """Candidate ``parallel`` sections of ``config`` (before the memory check), the fixed fields applied. Its
    ``stage_layers`` is kept where it splits the candidate's pipeline, else left to balance by size."""
    batch = config.training.global_batch_size
    split = config.parallel.stage_layers
    fixed = {key: value for key, value in request.fixed.items() if key != "activation_checkpointing"}
    for mesh in meshes(config, request):
        data_ranks = mesh["dp"] * mesh["ep"]
        if batch % data_ranks:
            continue
        pp = mesh["pp"]
        counts = [m for m in divisors(batch // data_ranks) if pp == 1 or m >= pp]
        if mesh["cp"] > 1:  # split a sequence only once microbatches are down to one: before, split the batch
            counts = [batch // data_ranks] if batch // data_ranks >= pp else []
        for zero, m, schedule, sp in itertools.product(range(4), counts, SCHEDULES if pp > 1 else ["1f1b"], (0, 1)):
            if sp and mesh["tp"] == 1:
                continue
            # a V holds two stages a rank; interleaving takes any count, two unless the user fixed one
            virtual = 2 if schedule in ("interleaved", *V_SCHEDULES) else 1
            if schedule == "interleaved":
                virtual = int(fixed.get("virtual_stages", 2))  # type: ignore[call-overload]
            if virtual > 1 and virtual * pp > config.model.num_layers + 2:
                continue  # fewer layers than stages
            if (schedule == "interleaved" and m % pp) or (schedule == "dualpipev" and m < 2 * pp):
                continue
            for style, ulysses in _cp_styles(config, mesh["cp"], mesh["tp"], fixed.get("cp_ulysses")):
                yield from _fixed(
                    config.parallel,
                    request,
                    fixed,
                    dp=mesh["dp"],
                    tp=mesh["tp"],
                    pp=pp,
                    ep=mesh["ep"],
                    cp=mesh["cp"],
                    cp_style=style,
                    cp_ulysses=ulysses,
                    zero_stage=zero,
                    microbatches=m,
                    schedule=schedule,
                    virtual_stages=virtual,
                    sequence_parallel=bool(sp),
                    stage_layers=split if split is None or len(split) == pp * virtual else None,
                    dp_shard=None,
                )


def _fixed(
    parallel: ParallelConfig, request: Request, fixed: Mapping[str, object], **chosen: Any
) -> Iterator[ParallelConfig]:
    """``parallel`` with the ``chosen`` fields, and its hybrid twin, where they keep what the user fixed."""
    for candidate in _with_hybrid(
        dataclasses.replace(parallel, **chosen), request.devices_per_node, fixed.get("dp_shard")
    ):
        if all(_chosen(candidate, key) == value for key, value in fixed.items()):
            yield candidate


def _cp_styles(config: Config, cp: int, tp: int, wanted: object = None) -> list[tuple[str, int | None]]:
    """The cp styles weighed for ``cp`` ranks: the config's own without cp (it does nothing then); with cp the
    ring, the all-gather, Ulysses where a tp rank's heads split over cp, and Ulysses x ring with the largest
    all-to-all group the heads allow (for more cp ranks than heads), or the group the user fixed (``wanted``)."""
    if cp == 1:
        style = config.parallel.cp_style
        return [("ring", None) if style == "ulysses+ring" else (style, None)]
    heads, kv = config.model.num_heads // tp, max(1, config.model.kv_heads // tp)

    def splits(group: int) -> bool:
        return heads % group == 0 and (kv % group == 0 or group % kv == 0)

    out: list[tuple[str, int | None]] = [("ring", None), ("allgather", None)]
    out += [("ulysses", None)] if splits(cp) else []
    inner = [u for u in divisors(cp) if 1 < u < cp and splits(u) and wanted in (None, u)]
    return out + ([("ulysses+ring", inner[-1])] if inner else [])


def _chosen(parallel: ParallelConfig, key: str) -> object:
    """``parallel``'s value of a :data:`CHOSEN` field as the user would fix it (dp_shard: dp when unset)."""
    return (parallel.dp_shard or parallel.dp) if key == "dp_shard" else getattr(parallel, key)


def _with_hybrid(parallel: ParallelConfig, devices_per_node: int, wanted: object = None) -> list[ParallelConfig]:
    """``parallel``, and under ZeRO with a shard group (dp x ep x cp x tp ranks) wider than a node, also its
    hybrid-sharded twin with the largest dp_shard whose group fits in one node: ZeRO's reduce-scatter and
    gathers stay on the node and only the all-reduce of each rank's 1/dp_shard of the gradients crosses,
    for the memory of sharding over fewer ranks. (Across nodes both exist; the costs choose.) A dp_shard
    the user fixed (``wanted``) is the twin's instead, wherever its group falls."""
    inner = parallel.ep * parallel.cp * parallel.tp
    if isinstance(wanted, int) and parallel.zero_stage > 0 and wanted < parallel.dp and parallel.dp % wanted == 0:
        return [dataclasses.replace(parallel, dp_shard=wanted)]
    if parallel.zero_stage == 0 or parallel.dp == 1 or parallel.dp * inner <= devices_per_node:
        return [parallel]
    fits = [d for d in divisors(parallel.dp) if d < parallel.dp and d * inner <= devices_per_node]
    return [parallel] + ([dataclasses.replace(parallel, dp_shard=max(fits))] if fits else [])


@dataclass(frozen=True)
class Plan:
    ranked: list[Candidate]
    """The best fitting layouts, simulated with their own costs, fastest first."""
    considered: int
    """Layouts polyshard can run that were weighed."""
    fitting: int
    """Of those, how many fit in memory (the screen ranked them all)."""


def search(config: Config, request: Request, profile: Profile, simulated: int = SIMULATED) -> Plan:
    """The best ``simulated`` layouts that fit, fastest first, and how many were considered and fit."""
    budget = request.memory_gb * 1e9
    fitting: list[Candidate] = []
    considered = 0
    fixed_mode = request.fixed.get("activation_checkpointing")
    fixed_mode = "full" if fixed_mode is True else fixed_mode  # true is what "full" was called before
    for parallel in layouts(config, request):
        for checkpointing in RECOMPUTE:  # the least recompute that fits
            if fixed_mode is not None and fixed_mode != checkpointing:
                continue
            training = dataclasses.replace(config.training, activation_checkpointing=checkpointing)
            candidate = dataclasses.replace(config, parallel=parallel, training=training)
            try:
                validate(candidate, world_size=request.devices)
            except ConfigError:
                break
            considered += 1
            states = max((rank_model_states(candidate, r) for r in range(parallel.pp)), key=lambda s: s.total)
            if states.total > budget:
                break  # checkpointing does not shrink model states
            memory = memory_of(candidate)
            if memory.total <= budget:
                screen = estimate_step(candidate, profile, exact=False)
                fitting.append(Candidate(candidate, memory, {}, screen))
                break  # checkpointing would only slow a layout that already fits
    fitting.sort(key=lambda c: (c.step_s, c.memory.total))
    best = []
    for c in fitting[:simulated]:
        best.append(dataclasses.replace(c, comm_bytes=comm_of(c.config), step=estimate_step(c.config, profile)))
    best.sort(key=lambda c: (c.step_s, c.memory.total))
    return Plan(best, considered, len(fitting))
