"""``optimizer.idle_experts = "skip"``: experts that took no tokens in a step are left exactly as they were.
(The default, "step", does not use this module: AdamW steps a layer's stacked experts whole, an idle
expert with its zero gradient, as transformers 5, torchtitan and Megatron-Core do.)

One process and PyTorch's DDP leave a parameter without a gradient untouched:
AdamW neither decays it nor moves it with its momentum. An expert that received
no tokens on any rank is that case, but its weights are rows of stacked tensors
(:class:`polyshard.models.common.moe.GroupedExperts`, one row block per expert), which AdamW
steps whole. So around each optimizer step the rows of idle experts are copied
aside and put back afterwards, in every tensor that holds them: the weights
(ZeRO-3: this rank's rows), ZeRO's fp32 masters and the AdamW moments.

Which experts were idle costs one all-reduce of the row counts over the ranks
holding the same experts (dp x cp): each local expert's count already
includes every ep rank's tokens. A
tensor's placement record says which global expert its local row ``j`` is
(ep and ZeRO shard dim 0, the expert dim), so the same rule serves every
layout.

Limits: AdamW's ``step`` counter is one per stacked tensor and still
advances, so when an idle expert is routed to again its bias correction is
that of the tensor, not of an expert stepped fewer times (per-expert
parameters would differ there). Rows are counted in every forward run with
gradients enabled between two optimizer steps; a forward outside the
training step that computes gradients is counted too. PyTorch's own AdamW on
stacked expert weights, without this guard, decays idle experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from polyshard.collectives import ops
from polyshard.dp import FullyShardedDataParallel, ZeroOptimizer
from polyshard.mesh import TensorPlacement, get_placement
from polyshard.models.anatomy import moe_layers
from polyshard.models.common.moe import MoELayer
from polyshard.trainer.engine.engine import Engine


def _moe_layers(engine: Engine) -> list[tuple[int, str, MoELayer]]:
    return [(index, name, module) for index, stage in engine.stages.items() for name, module in moe_layers(stage)]


def _idle_experts(engine: Engine, layers: list[tuple[int, str, MoELayer]]) -> list[set[int]]:
    """Per MoE layer, the global indices of its experts that processed no row on any data or cp rank."""
    counts = [layer.take_rows_seen() for _, _, layer in layers]
    total = torch.cat(counts).to(engine.device)
    axes = engine.config.parallel.expert_replica_axes
    # Under sequence parallelism each tp rank's experts see its own sequence shard: sum over tp too (where
    # tp ranks see the same tokens the sum is a multiple of each one's count, zero exactly where they are).
    ops.all_reduce(total, engine.mesh.group((*axes, "tp") if engine.config.parallel.tp > 1 else axes))
    idle, offset = [], 0
    for local in counts:
        first = engine.mesh.coord("ep") * len(local)  # this rank's experts are a contiguous range
        idle.append({first + e for e, n in enumerate(total[offset : offset + len(local)].tolist()) if n == 0})
        offset += len(local)
    return idle


def _held_tensors(
    engine: Engine, index: int, local_name: str, param: nn.Parameter
) -> Iterator[tuple[torch.Tensor, TensorPlacement | None]]:
    """Every tensor holding rows of ``param`` on this rank, with the record that places its rows."""
    wrapper = engine.wrappers[index]
    if engine.config.parallel.zero_stage == 3:
        view = cast(FullyShardedDataParallel, wrapper).local_shards()[local_name]  # ZeRO-3's wrapper
        yield view, get_placement(view)
    else:
        yield param, get_placement(param)
    optimizer = engine.optimizers[list(engine.wrappers).index(index)]
    stepped, inner = param, optimizer
    if isinstance(optimizer, ZeroOptimizer):
        stepped, inner = optimizer.masters[id(param)], optimizer.optimizer
        yield stepped, get_placement(stepped)
    for value in inner.state.get(stepped, {}).values():
        if isinstance(value, torch.Tensor) and value.shape == stepped.shape and value.dim():
            yield value, get_placement(value) or get_placement(stepped)


def _local_rows(record: TensorPlacement, length: int, idle: set[int], engine: Engine) -> list[int]:
    layout = engine.mesh.layout
    start = record.local_slices(layout.as_dict(), layout.coords(engine.mesh.rank))[0].start
    return [j for j in range(length) if start + j in idle]


@contextlib.contextmanager
def keep_idle_experts(engine: Engine) -> Iterator[None]:
    """Run the optimizer step inside: experts no data rank routed a token to come out unchanged."""
    layers = _moe_layers(engine)
    if not layers:
        yield
        return
    saved = []
    for (index, name, layer), idle in zip(layers, _idle_experts(engine, layers)):
        if not idle:
            continue
        for weight, param in layer.experts.named_parameters():
            for tensor, record in _held_tensors(engine, index, f"{name}.experts.{weight}", param):
                # Every tensor _held_tensors yields has a record: parameters, ZeRO-3 views, masters, moments.
                rows = _local_rows(cast(TensorPlacement, record), tensor.shape[0], idle, engine)
                if rows:
                    saved.append((tensor, rows, tensor.detach()[rows].clone()))
    yield
    with torch.no_grad():
        for tensor, rows, values in saved:
            tensor[rows] = values
