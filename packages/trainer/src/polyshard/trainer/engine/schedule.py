"""The learning-rate schedules: warmup, then cosine, linear, constant or warmup-stable-decay, by step."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from polyshard.trainer.config import Config


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


def schedule_of(config: Config) -> Callable[[int], float]:
    """``step -> learning rate`` as ``config`` sets it ([lr_schedule] from optimizer.lr over training.steps;
    steps counted from 0)."""
    schedule, steps = config.lr_schedule, config.training.steps
    return functools.partial(
        lr_at,
        lr=config.optimizer.lr,
        min_lr=schedule.min_lr,
        warmup_steps=schedule.warmup_steps,
        total_steps=steps,
        schedule=schedule.name,
        decay_steps=schedule.decay_steps(steps),
        decay_shape=schedule.decay_shape,
    )
