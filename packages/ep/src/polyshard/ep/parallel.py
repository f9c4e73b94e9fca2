"""Expert parallelism: shard every MoE layer's experts over an ep group, and fix up gradients.

A layer takes part when it follows :class:`ExpertLayer` (its experts' weights stacked on dim 0, a
router, the groups it dispatches and shares statistics over): ep defines no layer of its own.

Rank i of a group of size P keeps experts [i*E/P, (i+1)*E/P) of each layer;
the router (and everything else) stays replicated. Every expert parameter gets
a placement record ``Shard(0)`` over the ep axis, the router ``Replicate()``.

Gradients after ``loss.backward()``, with each rank's loss the mean over its own tokens:

* an expert's gradient already sums the contributions of every rank's tokens
  (the backward all-to-all brought them), i.e. the gradient of sum_r loss_r;
  the single-process loss on the union of tokens is (1/P) sum_r loss_r, so it
  is divided by P;
* a replicated parameter's gradient holds only this rank's tokens; averaging
  over the group gives the same (1/P) sum_r.

:func:`sync_gradients` does both; call it once per optimizer step, after the
last backward (it divides the *accumulated* expert gradients, so calling it
after every microbatch would divide the earlier ones again) and before
``optimizer.step()``. With data parallelism on top, let dp reduce instead:
scale the expert grads here (:func:`scale_expert_gradients`) and hand dp the
expert parameters with the dp group and the rest with the dp x ep group.
With context parallelism (cp ranks holding parts of the same sequences),
:func:`share_routing_statistics` gives the layers the cp group, expert
gradients sum over dp x cp (every rank holding the same experts) divided by
dp x ep x cp, and the rest average over dp x ep x cp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import ops
from polyshard.ep.errors import ExpertParallelError, check_ep_size
from polyshard.mesh import Replicate, Shard, TensorPlacement, get_placement, set_placement


@runtime_checkable
class ExpertLayer(Protocol):
    """What expert parallelism needs of a mixture-of-experts layer (a model defines the layer:
    :class:`polyshard.models.common.moe.MoELayer` is one). Its forward sends tokens to their experts with
    :func:`polyshard.ep.dispatch` over ``ep_group`` and back with :func:`polyshard.ep.combine`."""

    num_experts: int
    """Experts E over every rank (the ``experts`` module holds E/P of them once sharded)."""
    capacity_factor: float | None
    """None when dropless; otherwise the capacity rule needs every token's sequence position."""
    experts: nn.Module
    """Every parameter stacked on dim 0, one row block per expert: sharding keeps a slice."""
    router: nn.Module
    """Replicated over ep."""
    ep_group: dist.ProcessGroup | None
    """The group the layer dispatches over; None until :func:`apply_expert_parallel`."""
    token_group: dist.ProcessGroup | None
    """Ranks holding other parts of the same sequences, over which the routing losses are computed."""
    positions: torch.Tensor | None
    """(S_local,) this rank's sequence positions within the token group (the capacity rule's order)."""
    loss_sharers: int
    """Ranks of ``token_group`` that share one copy of the loss (tp under sequence parallelism)."""


def expert_layers(model: nn.Module) -> list[tuple[str, ExpertLayer]]:
    """Every :class:`ExpertLayer` of ``model``, by module name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertLayer)]


def apply_expert_parallel(model: nn.Module, *, group: dist.ProcessGroup, axis: str = "ep") -> nn.Module:
    """Keep only this rank's experts in every :class:`ExpertLayer` of ``model`` (in place) and return it.

    Every rank must hold the same full model before the call (e.g. built from one seed).
    """
    layers = expert_layers(model)
    if not layers:
        raise ExpertParallelError(
            f"{type(model).__name__} contains no MoE layer (a polyshard.ep.ExpertLayer); there are no experts to shard"
        )
    for name, layer in layers:
        _shard_layer(layer, name, group, axis)
    return model


def _shard_layer(layer: ExpertLayer, name: str, group: dist.ProcessGroup, axis: str) -> None:
    if layer.ep_group is not None:
        raise ExpertParallelError(f"MoE layer {name!r} is already expert-parallel; apply_expert_parallel once")
    ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    num_experts = layer.num_experts
    check_ep_size(num_experts, ep_size)
    local = num_experts // ep_size
    prefix = f"{name}." if name else ""
    for weight_name, param in list(layer.experts.named_parameters()):
        shard = nn.Parameter(param.detach()[ep_rank * local : (ep_rank + 1) * local].clone())  # (E/P, ...)
        record = TensorPlacement(f"{prefix}experts.{weight_name}", tuple(param.shape), ((axis, Shard(0)),))
        setattr(layer.experts, weight_name, set_placement(shard, record))
    for router_name, router in layer.router.named_parameters():  # the weight, and a logit bias if any
        record = TensorPlacement(f"{prefix}router.{router_name}", tuple(router.shape), ((axis, Replicate()),))
        set_placement(router, record)
    layer.ep_group = group


def share_routing_statistics(
    model: nn.Module,
    *,
    group: dist.ProcessGroup,
    positions: torch.Tensor | None = None,
    loss_sharers: int = 1,
    skip: Callable[[str], bool] | None = None,
) -> nn.Module:
    """Make every :class:`ExpertLayer` of ``model`` compute its auxiliary losses (and capacity) over the
    tokens of ``group``: the ranks holding parts of the same sequences (cp, and tp under sequence
    parallelism). In place; returns ``model``. ``positions``: (S_local,) the sequence positions of this
    rank's tokens, which the capacity rule needs. ``loss_sharers``: the group's ranks that share one copy
    of the loss (tp's size under sequence parallelism). ``skip``: layers by name to leave as they are."""
    layers = [(name, m) for name, m in expert_layers(model) if not (skip and skip(name))]
    if not layers:
        raise ExpertParallelError(f"{type(model).__name__} contains no MoE layer; there are no routing statistics")
    for name, layer in layers:
        if layer.capacity_factor is not None and positions is None:
            raise ExpertParallelError(
                f"MoE layer {name!r} has capacity_factor={layer.capacity_factor}: the capacity rule ranks "
                "the whole batch's tokens in sequence order; pass positions= (this rank's sequence positions, "
                "e.g. polyshard.cp.position_ids) or use capacity_factor=None (dropless)"
            )
        layer.token_group, layer.positions, layer.loss_sharers = group, positions, loss_sharers
    return model


def is_expert_parameter(param: torch.Tensor, axis: str = "ep") -> bool:
    """True for a tensor sharded over ``axis`` by :func:`apply_expert_parallel`."""
    record = get_placement(param)
    return record is not None and isinstance(record.placement(axis), Shard)


def expert_parameters(model: nn.Module, axis: str = "ep") -> list[nn.Parameter]:
    return [p for p in model.parameters() if is_expert_parameter(p, axis)]


def replicated_parameters(model: nn.Module, axis: str = "ep") -> list[nn.Parameter]:
    """Every parameter not sharded over ``axis``: router, attention, embeddings..."""
    return [p for p in model.parameters() if not is_expert_parameter(p, axis)]


def scale_expert_gradients(model: nn.Module, ep_size: int, axis: str = "ep") -> None:
    """Divide expert gradients by P: they hold the sum over every rank's tokens (see module docstring)."""
    for param in expert_parameters(model, axis):
        if param.grad is not None:
            param.grad.div_(ep_size)


def average_replicated_gradients(model: nn.Module, group: dist.ProcessGroup, axis: str = "ep") -> None:
    """Average non-expert gradients over ``group`` with one all-reduce of a flat buffer."""
    grads = [p.grad for p in replicated_parameters(model, axis) if p.grad is not None]
    ops.all_reduce_coalesced(grads, group, divide_by=dist.get_world_size(group))


def sync_gradients(model: nn.Module, group: dist.ProcessGroup, axis: str = "ep") -> None:
    """Make this rank's gradients those of the single-process loss on all ranks' tokens.

    Call once per step, after the last ``loss.backward()`` and before ``optimizer.step()``, when ep is the
    only data-splitting axis (no dp wrapper reducing the replicated parameters).
    """
    scale_expert_gradients(model, dist.get_world_size(group), axis)
    average_replicated_gradients(model, group, axis)


def planned_expert_placement(name: str, shape: tuple[int, ...], axis: str = "ep") -> TensorPlacement | None:
    """The record :func:`apply_expert_parallel` gives parameter ``name`` of a model's MoE layers,
    from its name alone (``*.experts.<w>`` is split over ``axis``, ``*.router.<p>`` replicated);
    None for a parameter that is not part of an MoE layer. Used to lay out checkpoints offline."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] == "experts":
        return TensorPlacement(name, tuple(shape), ((axis, Shard(0)),))
    if len(parts) >= 2 and parts[-2] == "router" and parts[-1] in ("weight", "logit_bias"):  # gpt-oss: a bias
        return TensorPlacement(name, tuple(shape), ((axis, Replicate()),))
    return None
