"""Model states per rank: parameters, gradients and optimizer state, under ZeRO 0-3 and fp32/bf16.

Two accountings of the same thing:

* :func:`zero_paper_bytes`, the ZeRO paper's (Rajbhandari et al. 1910.02054, section 3.1 and
  Figure 1): Ψ parameters on N ranks, 2 bytes of weight and 2 of gradient, K bytes of optimizer
  state per parameter (mixed-precision Adam: fp32 master, m, v, so K = 12)::

      plain DP  (2 + 2 + K) Ψ          ZeRO-1  (2 + 2) Ψ + K Ψ / N
      ZeRO-2    2 Ψ + (2 + K) Ψ / N    ZeRO-3  (2 + 2 + K) Ψ / N

* :func:`model_state_bytes`, what polyshard's engine holds at the optimizer step, to the byte, from
  the shapes a rank holds (:func:`holdings`): each parameter's dim 0 padded to a multiple of N for
  ZeRO (:class:`polyshard.dp.ShardSpec`), one presence flag per parameter in every gradient row
  (none where a gradient has nothing to reduce: one replica, fp32, stages 0-2),
  AdamW's float32 ``step`` per parameter, gradients reduced in fp32 also under bf16, and fp32
  master copies where the optimizer steps them (ZeRO-1/2 always; at ZeRO-3 under fp32 the
  master *is* the local shard). Under ``optimizer.name = "muon"`` the blocks' matrices keep one
  float32 momentum buffer (K = 4, no step counter) instead of AdamW's two moments (K = 8); the rank
  that orthogonalises a matrix also holds it whole for a moment, one matrix at a time, which is
  not counted here (it is not held at the step's end). ``tests/planner/test_memory.py`` checks it against
  :func:`polyshard.dp.bytes_held` on real engines.

A LoRA run (``[lora]``) holds its adapters as trainable parameters (A (r, in) and B (out, r) beside each
target, split over tp as their base is) and every other parameter frozen: its bytes alone (ZeRO-3: its
padded rows), in ``model.frozen_dtype`` for the frozen matrices' modules or bf16 under mixed precision,
and no gradient, flag or optimizer state.

Hybrid sharding (``parallel.dp_shard``) shards over the shard group only: N above is the shard
group's size (dp_shard x ep x cp), not the number of replicas, so a rank holds what ZeRO on
dp_shard x ep x cp ranks would; the dp / dp_shard replicas each hold the same.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from polyshard.dp import ShardSpec
from polyshard.mesh import Replicate, TensorPlacement
from polyshard.models import build_model, layer_of, spec_of, tied_names
from polyshard.models.common.lora import is_adapter
from polyshard.planner.lora_states import adapter_shapes, frozen_bytes, matrix_modules
from polyshard.planner.pipeline import stages_by_rank
from polyshard.trainer.checkpointing.records import base_record, data_axes, shard_axes
from polyshard.trainer.config import Config, ModelConfig
from polyshard.trainer.engine.layout import pipeline_bounds

FLAG_AND_GRAD_BYTES = 4  # gradients (and their presence flags) are reduced and kept in fp32
STEP_BYTES = 4  # AdamW's per-parameter step counter, a float32 scalar


@dataclass(frozen=True)
class ModelStates:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_paper_bytes(
    num_params: float, replicas: int, zero_stage: int, *, weight: int = 2, grad: int = 2, optimizer: int = 12
) -> ModelStates:
    """The ZeRO paper's bytes per device (see the module docstring); K = ``optimizer``."""
    n = replicas
    return ModelStates(
        params=weight * num_params / (n if zero_stage >= 3 else 1),
        grads=grad * num_params / (n if zero_stage >= 2 else 1),
        optimizer=optimizer * num_params / (n if zero_stage >= 1 else 1),
    )


@dataclass(frozen=True)
class Held:
    """A parameter as one rank holds it before ZeRO: its shape after tp and ep, and how many ranks
    replicate it (the group its gradient averages over and ZeRO shards it over)."""

    shape: tuple[int, ...]
    replicas: int
    tp_sharded: bool = False
    """Split over tp (a replicated 1-D weight under sequence parallelism has its gradient summed over tp)."""
    shards: int | None = None
    """Hybrid sharding: the ranks ZeRO shards it over (a divisor of ``replicas``); None: all replicas."""
    muon: bool = False
    """Stepped by Muon (one momentum buffer) rather than AdamW (two moments and a step counter)."""
    sequence_summed: bool = False
    """Replicated over tp but run on each tp rank's sequence shard under sequence parallelism, its gradient
    summed over tp: an MoE block's router and experts and a shared expert's gate (the norms: 1-D and not
    ``tp_sharded``); a LoRA factor whose gradient is partial over tp."""
    frozen_bytes: int | None = None
    """A frozen parameter (LoRA's base): its bytes per element; no gradient, no optimizer state. None:
    trained."""

    @property
    def shard_ranks(self) -> int:
        """The ranks ZeRO splits it over: ``shards``, or every replica without hybrid sharding."""
        return self.replicas if self.shards is None else self.shards


def model_state_bytes(held: Mapping[Held, int], zero_stage: int, precision: str) -> ModelStates:
    """Bytes polyshard's engine holds for ``held`` (parameter -> how many of it) at the optimizer step."""
    weight = 2 if precision == "bf16" else 4
    numel = shard = flags = grad_rows = padded = 0  # whole, this rank's ZeRO rows, flags, gradient buffer, padded
    state = 0  # bytes of optimizer state besides masters: per element 8 (AdamW's m, v) or 4 (Muon's buffer)
    masters = precision == "bf16"  # a separate fp32 copy the optimizer steps; in fp32 it steps the weight's rows
    frozen = 0  # bytes of frozen parameters: whole at stages 0-2 (no bucket pads them), ZeRO-3's rows
    for h, count in held.items():
        if h.frozen_bytes is not None:
            held_numel = ShardSpec(h.shape, h.shard_ranks).shard_numel if zero_stage == 3 else math.prod(h.shape)
            frozen += count * h.frozen_bytes * held_numel
            continue
        n = h.shard_ranks if zero_stage >= 1 else 1  # stage 0 reduces whole gradients: no padding
        rows = ShardSpec(h.shape, n).shard_numel
        numel += count * math.prod(h.shape)
        shard += count * rows
        # A gradient with nothing to reduce (one replica, already fp32, stages 0-2) stays in p.grad: no
        # bucket, no presence flag (polyshard.dp.buckets, "solo")
        flag = 0 if h.replicas == 1 and precision != "bf16" and zero_stage < 3 else 1
        flags += count * flag
        grad_rows += count * n * (rows + flag)  # ZeRO-1 keeps every rank's row of the bucket
        padded += count * n * rows
        elems = count * (rows if zero_stage >= 1 else math.prod(h.shape))
        moments = 4 if h.muon else 8  # Muon's momentum buffer, or AdamW's exp_avg and exp_avg_sq
        state += (moments + (4 if masters else 0)) * elems + (0 if h.muon else STEP_BYTES * count)
    grads = {0: numel + flags, 1: grad_rows, 2: shard + flags, 3: shard + flags}[zero_stage]
    params = numel
    if zero_stage == 3:
        params = shard
    elif zero_stage >= 1 and not masters:  # storage padded to whole rows per rank: each rank's rows are a view
        params = padded
    return ModelStates(
        params=weight * params + frozen,
        grads=FLAG_AND_GRAD_BYTES * grads,
        optimizer=state,
    )


def global_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape, from a build on the meta device (a tied alias is not listed).
    Cached by the model's repr: a list field (layer_types) leaves the config itself unhashable."""
    key = repr(model)
    if key not in _SHAPES:
        if len(_SHAPES) >= 32:
            _SHAPES.clear()
        skeleton = build_model(model, layers=())
        _SHAPES[key] = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
    return _SHAPES[key]


_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {}


def _matrix_modules(model: ModelConfig) -> set[str]:
    key = repr(model)
    if key not in _MATRIX_MODULES:
        _MATRIX_MODULES.clear()  # one model at a time is asked about, layout after layout
        _MATRIX_MODULES[key] = matrix_modules(global_shapes(model))
    return _MATRIX_MODULES[key]


_MATRIX_MODULES: dict[str, set[str]] = {}


def run_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """:func:`global_shapes` plus, in a LoRA run, every adapter's two factors (under their linear's name)."""
    return {**global_shapes(config.model), **adapter_shapes(config)}


def _records(config: Config) -> dict[str, TensorPlacement]:
    """Every parameter's record after tp and ep, as the engine places it
    (:func:`~polyshard.trainer.checkpointing.records.base_record`). Each record looks the name up in the whole
    tp plan, so they are worked out once per model, tp size, sequence parallelism (all of the parallel
    section the tp plan reads) and adapters, not once per layout."""
    par = config.parallel
    key = (repr(config.model), par.tp, par.sequence_parallel, repr(config.lora))  # repr: layer_types is a list
    if key not in _RECORDS:
        _RECORDS[key] = {name: base_record(config, name, shape) for name, shape in run_shapes(config).items()}
    return _RECORDS[key]


_RECORDS: dict[tuple[str, int, bool, str], dict[str, TensorPlacement]] = {}


def _held(config: Config, record: TensorPlacement) -> Held:
    """A parameter's ``record`` after tp and ep, replicated over the axes the data-parallel wrapper spans
    for it (:func:`~polyshard.trainer.checkpointing.records.data_axes`)."""
    par = config.parallel
    sizes = par.mesh_axes
    replicas = math.prod(sizes[a] for a in data_axes(config, record))
    tp_sharded = record.placement("tp") != Replicate() if par.tp > 1 else False
    shards = math.prod(sizes[a] for a in shard_axes(config, record)) if par.hybrid else None
    summed = par.tp > 1 and par.sequence_parallel and routes_sequence_shards(record.name)
    # a LoRA factor beside a tp-split base, whole on every tp rank: its gradient is partial over tp
    summed = summed or (par.tp > 1 and is_adapter(record.name) and not tp_sharded)
    frozen = frozen_bytes(config, record.name, _matrix_modules(config.model))
    muon = frozen is None and _stepped_by_muon(config, record)
    return Held(
        record.local_shape(sizes), replicas, tp_sharded, shards, muon=muon, sequence_summed=summed, frozen_bytes=frozen
    )


def routes_sequence_shards(name: str) -> bool:
    """Whether parameter ``name`` belongs to an MoE block's routed part (or a shared expert's gate), which
    under sequence parallelism runs on each tp rank's sequence shard (not a prediction depth's: those run
    on whole sequences)."""
    moe = ".mlp.moe." in name or name.endswith(".mlp.shared_expert_gate.weight")
    return moe and ".mtp." not in name


def _stepped_by_muon(config: Config, record: TensorPlacement) -> bool:
    """Whether ``optimizer.name = "muon"`` steps this parameter with Muon (the family's rule, asked of a
    meta tensor of its global shape)."""
    if config.optimizer.name != "muon":
        return False
    return spec_of(config.model).orthogonalised(
        record.name, nn.Parameter(torch.empty(record.global_shape, device="meta"))
    )


def holdings(config: Config, pp_rank: int) -> Counter[Held]:
    """The parameters pipeline rank ``pp_rank`` holds (any dp/tp/ep coordinate holds the same shapes).

    A tied weight is one tensor where one stage uses both names, and a copy on each stage otherwise
    (also two stages of one rank: the engine unties them there). Cached: the planner asks for the
    same split of the same model under many ZeRO stages, microbatch counts and schedules."""
    par = config.parallel
    # The model by its repr: a list field (layer_types) makes the frozen dataclass itself unhashable.
    key: tuple[object, ...] = (repr(config.model), tuple(sorted(par.mesh_axes.items())), par.sequence_parallel)
    key += (par.zero_stage == 3, par.schedule if par.virtual_stages > 1 else "", par.virtual_stages)
    key += (tuple(par.stage_layers or ()), pp_rank, config.optimizer.name)
    key += (repr(config.lora), config.training.precision)  # LoRA's frozen bytes depend on the precision
    if key not in _HOLDINGS:
        _HOLDINGS[key] = _holdings(config, pp_rank)
    return _HOLDINGS[key]


_HOLDINGS: dict[tuple[object, ...], Counter[Held]] = {}


def _holdings(config: Config, pp_rank: int) -> Counter[Held]:
    par = config.parallel
    shapes = run_shapes(config)
    bounds = stage_bounds(config)
    placement = stages_by_rank(par.schedule, par.pp, par.virtual_stages)
    aliases = tied_names(config.model)
    records = _records(config)
    held: Counter[Held] = Counter()
    for stage in placement[pp_rank]:
        layers = bounds[stage]
        names = [n for n in shapes if layer_of(n) in layers]
        names += [n for a, n in aliases.items() if layer_of(a) in layers and layer_of(n) not in layers]
        held.update(_held(config, records[n]) for n in names)
    return held


def gathered_once(config: Config, pp_rank: int) -> Counter[Held]:
    """The parameters of :func:`holdings` that ZeRO-3 gathers once per microbatch rather than twice
    (before the forward and again before the backward): the root unit's, a weight tied within one stage
    (gathered when the stage's forward starts, kept through its backward), and the output head's, which
    stays gathered from its forward until its gradients are reduced
    (``FullyShardedDataParallel(keep_gathered=...)``). Under a schedule that alternates the last stage's
    forwards and backwards (1F1B and the like) that is once per microbatch; GPipe runs every forward first
    and gathers the kept head once per step, one gather fewer per further microbatch than counted here."""
    shapes = global_shapes(config.model)
    bounds = stage_bounds(config)
    head = bounds[-1][-1]
    aliases = tied_names(config.model)
    records = _records(config)
    par = config.parallel
    once: Counter[Held] = Counter()
    for stage in stages_by_rank(par.schedule, par.pp, par.virtual_stages)[pp_rank]:
        layers = bounds[stage]
        names = {n for a, n in aliases.items() if layer_of(a) in layers and layer_of(n) in layers}
        if head in layers:  # the head's own parameters, and its copy of a weight tied to another stage's
            names |= {n for n in shapes if layer_of(n) == head}
            names |= {n for a, n in aliases.items() if layer_of(a) == head and layer_of(n) not in layers}
        once.update(_held(config, records[n]) for n in names)
    return once


def tied_copy_elements(config: Config) -> list[int]:
    """Per weight tied across two pipeline stages, the float32 elements ``Engine._sum_tied_copies``
    all-reduces between its copies: the copy's gradient as this rank holds it (after tp; its ZeRO rows at
    stages 1-3) and one count of the copies without a gradient. None in a LoRA run: a frozen tied weight
    has no gradient to sum."""
    if config.lora is not None:
        return []
    records = _records(config)
    out = []
    for name in sorted(set(tied_names(config.model).values())):
        held = _held(config, records[name])
        whole = math.prod(held.shape)
        rows = ShardSpec(held.shape, held.shard_ranks).shard_numel if config.parallel.zero_stage else whole
        out.append(rows + 1)
    return out


def stage_bounds(config: Config) -> list[range]:
    """:func:`pipeline_bounds` of ``config`` (cached by the model and the split)."""
    par = config.parallel
    key = (repr(config.model), par.pp, par.virtual_stages, tuple(par.stage_layers or ()))
    if key not in _BOUNDS:
        _BOUNDS[key] = pipeline_bounds(config, global_shapes(config.model))
    return _BOUNDS[key]


_BOUNDS: dict[tuple[object, ...], list[range]] = {}


def rank_model_states(config: Config, pp_rank: int) -> ModelStates:
    par = config.parallel
    return model_state_bytes(holdings(config, pp_rank), par.zero_stage, config.training.precision)
