"""Split an ordered list of layers into contiguous pipeline stages.

The caller describes the model as an ordered list of *layer builders*
(zero-argument callables returning an ``nn.Module``). Costs come from a
caller's function of the layer index, or by default from parameter counts,
which are read from a copy built on the ``meta`` device (no memory used).
A rank then builds only the layers of its own stages, so it holds about
1/p of the model.

Example: parameter counts [10, 10, 10, 30] over 2 stages give
``[range(0, 3), range(3, 4)]`` (30 | 30), not the even split (20 | 40).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from polyshard.mesh import TensorPlacement, set_placement
from polyshard.pp.errors import PartitionError
from polyshard.pp.stage import Stage

LayerBuilder = Callable[[], nn.Module]


def balanced_partition(costs: Sequence[float], num_stages: int) -> list[range]:
    """Contiguous ranges of layer indices, one per stage, minimising the most expensive stage.

    Dynamic programme over (layers used, stages used); every stage gets at least one layer.
    """
    n = len(costs)
    if num_stages < 1:
        raise PartitionError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > n:
        raise PartitionError(
            f"cannot split {n} layers into {num_stages} stages (each stage needs a layer); "
            f"choose num_stages <= {n} or a model with more layers"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: smallest achievable max-stage cost putting the first i layers into s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append(range(cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


def parameter_counts(builders: Sequence[LayerBuilder]) -> list[int]:
    """Parameters per layer, counted on a meta-device copy (nothing is allocated)."""
    counts = []
    with torch.device("meta"):
        for build in builders:
            counts.append(sum(p.numel() for p in build().parameters()))
    return counts


def build_stages(
    builders: Sequence[LayerBuilder],
    num_stages: int,
    stages: Sequence[int],
    *,
    cost: Callable[[int], float] | None = None,
) -> dict[int, Stage]:
    """Build only ``stages`` (of ``num_stages``) as a :class:`~polyshard.pp.stage.Stage` of their layers.

    Each parameter gets a placement record naming its global layer
    (``layers.{i}.{name}``) so checkpoints can put the stages back together.
    """
    costs = [cost(i) for i in range(len(builders))] if cost is not None else parameter_counts(builders)
    ranges = balanced_partition(costs, num_stages)
    built = {}
    for stage in stages:
        if not 0 <= stage < num_stages:
            raise PartitionError(f"stage {stage} is out of range for {num_stages} stages; use 0..{num_stages - 1}")
        layers = []
        for i in ranges[stage]:
            layer = builders[i]()
            for name, param in layer.named_parameters():
                set_placement(param, TensorPlacement(f"layers.{i}.{name}", tuple(param.shape), (), layer=i))
            layers.append(layer)
        built[stage] = Stage(*layers)
    return built
