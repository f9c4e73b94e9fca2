"""Pure layout arithmetic, shared by every rank, ``--dry-run``, the planner and the offline resharder:
the tensor-parallel plan of the family, the pipeline split of its layers by cost, which parameter names
each stage holds, and whether ZeRO keeps master rows. It builds nothing and imports no strategy's
runtime (only the pipeline's pure partition function), so the planner and checkpoint records can ask it
without pulling in the strategies."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from torch import nn

from polyshard.models import active_share, layer_of, spec_of, tied_names
from polyshard.pp.partition import balanced_partition
from polyshard.trainer.config import Config


def tp_plan(config: Config, layers: Collection[int] | None = None) -> dict[str, Any]:
    """The model family's tensor-parallel plan (over names ``layers.{i}.attn.q_proj`` ...), for every
    pipeline layer or only ``layers``."""
    plan = spec_of(config.model).tp_plan(config.model, config.parallel)
    if layers is not None:
        plan = {pattern: style for pattern, style in plan.items() if layer_of(pattern) in layers}
    return plan


def pipeline_bounds(config: Config, shapes: Mapping[str, Sequence[int]]) -> list[range]:
    """Global layer indices of each pipeline stage: ``parallel.stage_layers`` when given, else
    balanced by :func:`layer_costs` of the global parameter ``shapes`` (this rank-independent
    split is what every rank, ``--dry-run`` and the offline resharder agree on). The cost is the
    parameters a token computes with: an MoE block's routed experts count top_k / num_experts of
    theirs, so a sparse block weighs its FLOPs beside a dense one, not its E experts' memory."""
    par = config.parallel
    if par.stage_layers is None:
        model = config.model
        costs = layer_costs(shapes, tied_names(model), share=lambda name: active_share(model, name))
        return balanced_partition(costs, par.pp * par.virtual_stages)
    bounds, start = [], 0
    for count in par.stage_layers:
        bounds.append(range(start, start + count))
        start += count
    return bounds


def layer_costs(
    shapes: Mapping[str, Sequence[int]],
    aliases: Mapping[str, str] | None = None,
    share: Callable[[str], float] | None = None,
) -> list[int]:
    """Parameters per pipeline layer, from global parameter shapes: what the pipeline split balances.
    It does not depend on tp, ep or dp, so every layout with the same stages splits alike. A tied
    weight (``aliases``: alias -> name) counts in its alias's layer too: that layer computes with it,
    and on another stage holds a copy. ``share(name)``: the part of a parameter that counts (the
    active part of routed experts; None: all of every parameter)."""
    costs: dict[int, int] = {}
    for name, shape in shapes.items():
        part = math.prod(shape) if share is None else round(math.prod(shape) * share(name))
        costs[layer_of(name)] = costs.get(layer_of(name), 0) + part
    for alias, name in (aliases or {}).items():
        if name in shapes:
            costs[layer_of(alias)] = costs.get(layer_of(alias), 0) + math.prod(shapes[name])
    return [costs[i] for i in sorted(costs)]


def keeps_masters(config: Config) -> bool:
    """Whether a ZeroOptimizer steps fp32 master rows (ZeRO, or bf16 parameters) rather than the parameters.
    In fp32 those rows are views of the parameters (or ZeRO-3's shards), not copies; checkpoints still
    save them under ``optim/<name>/master``, as before."""
    return config.parallel.zero_stage > 0 or config.training.precision == "bf16"


def global_names(stage: nn.Module, layer_ids: range, aliases: Mapping[str, str] | None = None) -> dict[str, str]:
    """Chunk-local names -> model names; a copy of a tied weight takes the weight's own name
    (``aliases``: alias -> name, see :func:`polyshard.models.tied_names`)."""
    aliases = aliases or {}
    out = {}
    for name, _ in stage.named_parameters():
        local, _, rest = name.partition(".")
        model_name = f"layers.{layer_ids[int(local)]}.{rest}"
        out[name] = aliases.get(model_name, model_name)
    return out
