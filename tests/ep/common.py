"""Helpers shared by the ep tests: seeded layers, per-rank data and the single-process reference.

Every rank builds the full layer and *all* ranks' tokens from one seed, so it
can compute the single-process answer itself and compare with its own slice.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from polyshard.ep import apply_expert_parallel, sync_gradients
from polyshard.mesh import Mesh
from polyshard.models.common.moe import MoEConfig, MoELayer

# float32 everywhere. The parallel layer runs each expert once on the rows of
# all ranks, the reference once per rank, so matmuls sum in a different
# blocking: differences are a few ulps of values O(1), far below 1e-5.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def make_layer(seed: int = 0, **overrides) -> MoELayer:
    config = dict(hidden=16, ffn_hidden=24, num_experts=4, top_k=2)
    config.update(overrides)
    torch.manual_seed(seed)
    hidden = config.pop("hidden")
    return MoELayer(MoEConfig(**config), hidden=hidden)


def rank_tokens(world: int, num_tokens: int, hidden: int, seed: int = 100) -> list[torch.Tensor]:
    """One (num_tokens, hidden) batch per rank."""
    return [torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + r)) for r in range(world)]


def rank_targets(world: int, num_tokens: int, hidden: int, seed: int = 200) -> list[torch.Tensor]:
    """Random upstream gradients, so every output element matters to the loss."""
    return [torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + r)) for r in range(world)]


def local_loss(y: torch.Tensor, aux: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss one rank computes on its own tokens: a mean over them plus its aux loss."""
    return (y * target).sum(dim=-1).mean() + aux


def ep_mesh() -> Mesh:
    return Mesh({"ep": dist.get_world_size()})


def parallel_copy(reference: MoELayer | torch.nn.Module, mesh: Mesh) -> torch.nn.Module:
    return apply_expert_parallel(copy.deepcopy(reference), group=mesh.group("ep"))


def run_reference(layer: MoELayer, xs, targets):
    """Single process, all experts: each rank's tokens through the layer, loss = mean of per-rank losses.

    Capacity and the aux loss are per-rank rules (each rank routes its own
    tokens), so the reference applies them per rank's batch too.
    """
    outputs, losses = [], []
    for x, target in zip(xs, targets):
        y, aux = layer(x)
        outputs.append(y)
        losses.append(local_loss(y, aux, target))
    torch.stack(losses).mean().backward()
    return [y.detach() for y in outputs]


def run_parallel(layer, x, target, mesh: Mesh):
    y, aux = layer(x)
    local_loss(y, aux, target).backward()
    sync_gradients(layer, mesh.group("ep"))
    return y.detach()


def expert_slice(full: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's experts [i*E/P, (i+1)*E/P) of a stacked (E, ...) tensor."""
    return full.chunk(mesh.size("ep"), dim=0)[mesh.coord("ep")]
