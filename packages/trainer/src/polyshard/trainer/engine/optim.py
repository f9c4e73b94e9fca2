"""AdamW and Muon parameter groups, the learning-rate schedules and the global gradient-norm clip."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import ops
from polyshard.mesh import Replicate, Shard, TensorPlacement, get_placement
from polyshard.models.spec import decays as default_decays
from polyshard.trainer.config import TrainingConfig

ADAMW_KERNELS: dict[str, dict[str, bool]] = {
    "auto": {},  # torch's own choice (foreach where the tensors allow it)
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for-loop": {"foreach": False},
}
"""``training.adamw_impl`` -> the keyword arguments of ``torch.optim.AdamW`` (and :class:`polyshard.dp.Muon`)."""


def adamw_kernel(train: TrainingConfig) -> dict[str, bool]:
    """The ``foreach`` / ``fused`` arguments ``training.adamw_impl`` names."""
    return ADAMW_KERNELS[train.adamw_impl]


def decay_rule(
    train: TrainingConfig, family: Callable[[str, nn.Parameter], bool]
) -> Callable[[str, nn.Parameter], bool]:
    """Which parameters AdamW decays: the family's rule (``weight_decay_params = "matrices"``) or every one
    (``"all"``, torchtitan's)."""
    return family if train.weight_decay_params == "matrices" else _every


def _every(name: str, param: nn.Parameter) -> bool:
    return True


def param_groups(
    named: Iterable[tuple[str, nn.Parameter]],
    weight_decay: float,
    decays: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[dict[str, Any]]:
    """AdamW's two groups: the parameters ``decays`` picks (by model name) and the rest, undecayed.

    ``named``: (model name, parameter) pairs. Model names, not stage-local ones, decide: a
    pipeline's copy of a tied embedding is named as the embedding, and is not decayed either.
    ``decays`` defaults to the usual rule, :func:`polyshard.models.spec.decays`.
    """
    decays = decays or default_decays
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in named:
        if not p.requires_grad:
            continue
        (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def muon_groups(
    named: Iterable[tuple[str, nn.Parameter]],
    weight_decay: float,
    decays: Callable[[str, nn.Parameter], bool],
    orthogonalised: Callable[[str, nn.Parameter], bool],
) -> list[dict[str, Any]]:
    """:class:`polyshard.dp.Muon`'s groups: the matrices ``orthogonalised`` picks (``muon=True``), then
    AdamW's two groups of :func:`param_groups` for the rest. Each Muon matrix is decayed when ``decays``
    says so (the blocks' matrices all are, by the usual rule)."""
    named = [(name, p) for name, p in named if p.requires_grad]
    matrices = [(name, p) for name, p in named if orthogonalised(name, p)]
    chosen = {id(p) for _, p in matrices}
    rest = [(name, p) for name, p in named if id(p) not in chosen]
    muon = [
        {"params": [p for name, p in matrices if decays(name, p) == wanted], "weight_decay": wd, "muon": True}
        for wanted, wd in ((True, weight_decay), (False, 0.0))
    ]
    return muon + param_groups(rest, weight_decay, decays)


def lr_at(
    step: int,
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str = "cosine",
    decay_steps: int = 0,
    decay_shape: str = "linear",
) -> float:
    """The learning rate of step ``step`` (counted from 0: the first optimizer step uses ``lr_at(0)``).

    Linear warmup to ``lr`` over ``warmup_steps``; then, until ``total_steps``:

    * ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``, p going 0 -> 1 after warmup;
    * ``linear``: ``lr - (lr - min_lr) * p``;
    * ``constant``: ``lr``;
    * ``wsd`` (warmup-stable-decay): ``lr`` until the last ``decay_steps``, then ``min_lr + (lr - min_lr)
      * f(q)`` with q going 0 -> 1 over them and f = 1 - q (linear), (1 + cos(pi q)) / 2 (cosine) or
      1 - sqrt(q) (sqrt). The decay's last step reaches ``min_lr``.

    Worked example, wsd with lr=1, min_lr=0, warmup 2, 10 steps, decay_steps 4, linear: steps 0..9 take
    0.5, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0. It depends on the step alone, so a resumed run continues it
    exactly.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return lr
    if schedule == "wsd":
        first = total_steps - decay_steps  # the first step below lr
        if step < first:
            return lr
        q = min(1.0, (step - first + 1) / decay_steps)
        return min_lr + (lr - min_lr) * _DECAY[decay_shape](q)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


_DECAY: dict[str, Callable[[float], float]] = {
    "linear": lambda q: 1.0 - q,
    "cosine": lambda q: 0.5 * (1.0 + math.cos(math.pi * q)),
    "sqrt": lambda q: 1.0 - math.sqrt(q),
}


def schedule_of(train: TrainingConfig) -> Callable[[int], float]:
    """``step -> learning rate`` as ``train`` sets it (steps counted from 0)."""
    return functools.partial(
        lr_at,
        lr=train.lr,
        min_lr=train.min_lr,
        warmup_steps=train.warmup_steps,
        total_steps=train.steps,
        schedule=train.lr_schedule,
        decay_steps=train.decay_steps,
        decay_shape=train.decay_shape,
    )


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
