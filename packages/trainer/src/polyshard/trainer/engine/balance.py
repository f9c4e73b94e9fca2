"""The experts' load over the whole global step, and DeepSeek-V3's auxiliary-loss-free balancing.

Each MoE layer counts, over its training forwards of a step, the assignments its router chose per
expert on this rank's tokens (:meth:`polyshard.models.common.moe.MoELayer.take_load`). After the optimizer step one
all-reduce over the world sums them: every rank that saw different tokens (the dp, ep and cp ranks,
and every microbatch) adds its counts, a tp rank adds them once (tp ranks route the same tokens;
under sequence parallelism each tp rank routes its own sequence shard and adds its counts too),
and each pipeline rank fills the rows of its own layers, so every rank learns every layer's load in
one collective, fused over the layers. The same vector carries each layer's bias before the update
(from the one rank at coordinate 0 of the replica and tp axes), so every rank can report every
layer's bias range after it.

The sums are of whole numbers in float64 (exact below 2**53), so every rank holds the same load as a
single process running the same global batch; a sigmoid router's bias then moves by
``router_bias_update_rate * sign(mean - load)`` (:meth:`polyshard.models.common.moe.Router.update_bias`) identically
on every rank: replicated state that never needs a broadcast.

Limit: one MoE layer per pipeline layer (every moe-gpt block has one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from polyshard.collectives import ops
from polyshard.models import anatomy
from polyshard.models.common.moe import MoELayer, Router
from polyshard.models.decoder import moe_config
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.errors import ConfigError

# Per layer: E loads, the tokens that lost every expert, the tokens routed, then the E biases before the update.


@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer's load in one global step (every rank holds the same)."""

    tokens_per_expert: tuple[int, ...]
    """Assignments each expert got over all tokens of the step (before capacity drops)."""
    dropped_tokens: int
    """Tokens that lost every one of their experts to the capacity rule."""
    tokens: int
    """Tokens routed."""
    bias_range: tuple[float, float] | None
    """(min, max) of the selection bias after this step's update; None for a router without one."""

    @property
    def max_over_mean(self) -> float:
        """Tokens of the busiest expert over the mean: 1 is perfect balance, E total collapse."""
        mean = sum(self.tokens_per_expert) / len(self.tokens_per_expert)
        return max(self.tokens_per_expert) / mean if mean else 0.0


def moe_layers(engine: Engine) -> dict[int, MoELayer]:
    """This rank's MoE layers by global pipeline layer index."""
    out: dict[int, MoELayer] = {}
    for index, stage in engine.stages.items():
        for position, block in enumerate(stage):
            found = [layer for _, layer in anatomy.moe_layers(block)]
            if len(found) > 1:
                raise ConfigError(f"pipeline layer {engine.layer_ids[index][position]} holds {len(found)} MoE layers; "
                                  "the load count keeps one per layer")  # fmt: skip
            if found:
                out[engine.layer_ids[index][position]] = found[0]
    return out


def _first_of_replicas(engine: Engine) -> bool:
    """Whether this rank is the first of those holding the same layers (every axis but pp)."""
    return engine.mesh.group_rank((*engine.config.parallel.replica_axes, "tp")) == 0


def balance_experts(engine: Engine, stepped: bool) -> dict[int, LayerLoad]:
    """After the optimizer step (one all-reduce over the world; every rank of an MoE model calls it):
    the step's load of every MoE layer, by global pipeline layer; with ``stepped`` (the step was taken)
    each sigmoid router's bias moves toward balance by ``model.router_bias_update_rate``."""
    moe = moe_config(engine.config.model).moe
    experts, rate = moe.num_experts, moe.bias_update_rate
    layers = moe_layers(engine)
    counts = {i: layer.take_load() for i, layer in layers.items()}  # always taken: a skipped step resets them
    sums = torch.zeros(engine.pipeline_layers, 2 * experts + 2, dtype=torch.float64)
    for i, load in counts.items():
        # tp ranks route the same tokens, counted once; under sequence parallelism (a token group shared
        # with tp: loss_sharers > 1) each routes its own sequence shard, and every one adds its counts.
        if engine.mesh.coord("tp") == 0 or layers[i].loss_sharers > 1:
            sums[i, : experts + 2] = load.double()
        bias = layers[i].router.bias
        if bias is not None and _first_of_replicas(engine):
            sums[i, experts + 2 :] = bias.double().cpu()  # a float32 is exact in float64; the others add 0
    sums = sums.to(engine.device)
    ops.all_reduce(sums)
    sums = sums.cpu()
    if stepped and rate > 0:
        for i, layer in layers.items():
            layer.router.update_bias(sums[i, :experts], rate)
    out = {}
    for i, row in enumerate(sums):
        if row[experts + 1] == 0:  # no tokens routed: no MoE layer there
            continue
        bias_range = None
        if moe.score == "sigmoid":
            bias = Router.updated_bias(row[experts + 2 :].float(), row[:experts], rate if stepped else 0.0)
            bias_range = (float(bias.min()), float(bias.max()))
        loads = tuple(int(n) for n in row[:experts].tolist())
        out[i] = LayerLoad(loads, int(row[experts]), int(row[experts + 1]), bias_range)
    return out


def load_metrics(loads: Mapping[int, LayerLoad]) -> dict[str, float | int | list[int]]:
    """The metrics record's fields for each MoE layer: ``moe/layer{i}/...``."""
    out: dict[str, float | int | list[int]] = {}
    for i, load in sorted(loads.items()):
        key = f"moe/layer{i}"
        out[f"{key}/tokens_per_expert"] = list(load.tokens_per_expert)
        out[f"{key}/tokens_max"] = max(load.tokens_per_expert)
        out[f"{key}/tokens_mean"] = sum(load.tokens_per_expert) / len(load.tokens_per_expert)
        out[f"{key}/max_over_mean"] = load.max_over_mean
        out[f"{key}/dropped_tokens"] = load.dropped_tokens
        if load.bias_range is not None:
            out[f"{key}/bias_min"], out[f"{key}/bias_max"] = load.bias_range
    return out
