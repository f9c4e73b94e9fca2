"""The global gradient norm, each element of the model counted once over every rank, and the clip to it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.mesh import Replicate, Shard, TensorPlacement, get_placement


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
    Returns the norm before clipping. (The training step runs the same two halves,
    :func:`local_squared_norm` and :func:`clip_to`, around an all-reduce it shares with the loss.)
    """
    local = local_squared_norm(gradients, axis_sizes)
    if dist.is_initialized() and dist.get_world_size() > 1:
        ops.all_reduce(local)
    total = float(local.sqrt())
    clip_to(total, max_norm, [g for g, _ in gradients], copies)
    return total


@torch.no_grad()
def local_squared_norm(
    gradients: Sequence[tuple[torch.Tensor, TensorPlacement | None]], axis_sizes: dict[str, int]
) -> torch.Tensor:
    """This rank's part of the global squared gradient norm (float64, 0-d; see :func:`clip_grad_norm`):
    summed over the world, every element of the global model counts once."""
    device = gradients[0][0].device if gradients else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float64, device=device)
    # One foreach norm per (copies, dtype) group instead of four kernels per gradient: per-step Python
    # that does not scale with the model (the tiny GPT's 34 gradients: 0.50 -> 0.26 ms, minima of 200 calls).
    groups: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for grad, record in gradients:
        groups.setdefault((_copies(record, axis_sizes), grad.dtype), []).append(grad.detach())
    for (copies, _), grads in groups.items():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float64)  # each summed in float64, as .double() did
        local += torch.stack(norms).square().sum() / copies
    return local


@torch.no_grad()
def clip_to(total: float, max_norm: float, gradients: Sequence[torch.Tensor], copies: Sequence[torch.Tensor]) -> None:
    """Scale ``gradients`` and ``copies`` in place so that a global norm ``total`` becomes ``max_norm``
    (nothing when it is within it, or ``max_norm`` is 0)."""
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        torch._foreach_mul_([*gradients, *copies], scale)  # each element times scale, as grad.mul_ does
