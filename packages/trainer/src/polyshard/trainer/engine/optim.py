"""AdamW parameter groups, the warmup + cosine schedule and the global gradient-norm clip."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import ops
from polyshard.mesh import Replicate, Shard, TensorPlacement, get_placement
from polyshard.trainer.models.spec import decays as default_decays


def param_groups(
    named: Iterable[tuple[str, nn.Parameter]],
    weight_decay: float,
    decays: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[dict[str, Any]]:
    """AdamW's two groups: the parameters ``decays`` picks (by model name) and the rest, undecayed.

    ``named``: (model name, parameter) pairs. Model names, not stage-local ones, decide: a
    pipeline's copy of a tied embedding is named as the embedding, and is not decayed either.
    ``decays`` defaults to the usual rule, :func:`polyshard.trainer.models.spec.decays`.
    """
    decays = decays or default_decays
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in named:
        if not p.requires_grad:
            continue
        (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``total_steps``.

    ``step`` counts from 0 (the first optimizer step uses ``lr_at(0)``).
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def _copies(record: TensorPlacement | None, axis_sizes: dict[str, int]) -> int:
    """How many ranks hold an identical copy of a gradient placed as ``record``.

    Axes the record shards over hold different pieces (sum them); replicated
    axes hold copies (count once). Pipeline stages hold different layers, so
    ``pp`` never makes copies. A tensor without a record is replicated on every
    axis but pp.
    """
    copies = 1
    for axis, size in axis_sizes.items():
        if axis == "pp":
            continue
        placement = record.placement(axis) if record is not None else Replicate()
        if not isinstance(placement, Shard):
            copies *= size
    return copies


def parameter_gradients(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, TensorPlacement | None]]:
    """(grad, placement record) pairs of parameters that have a gradient."""
    return [(p.grad, get_placement(p)) for p in params if p.grad is not None]


@torch.no_grad()
def clip_grad_norm(
    gradients: Sequence[tuple[torch.Tensor, TensorPlacement | None]],
    max_norm: float,
    axis_sizes: dict[str, int],
    copies: Sequence[torch.Tensor] = (),
) -> float:
    """Clip every gradient by one global norm, computed once over all ranks.

    ``gradients`` are (local gradient, its placement record) pairs — a
    parameter's ``.grad``, or a ZeRO shard of it. Each rank sums its local
    squared norms, each divided by the number of ranks holding an identical
    copy (read from the records), and a single all-reduce over the world adds
    them: every element of the global model counts exactly once. ``copies``
    are gradients equal to counted ones that the records cannot tell apart
    (a pipeline's second copy of a tied weight): scaled alike, never counted.
    Returns the norm before clipping.
    """
    device = gradients[0][0].device if gradients else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float64, device=device)
    for grad, record in gradients:
        local += grad.detach().double().pow(2).sum() / _copies(record, axis_sizes)
    if dist.is_initialized() and dist.get_world_size() > 1:
        ops.all_reduce(local)
    total = float(local.sqrt())
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for grad in [g for g, _ in gradients] + list(copies):
            grad.mul_(scale)
    return total
