"""Evaluation: forward only, in eval mode, pipelined like training, over any number of batches."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from polyshard.collectives import ops
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.tasks.loss import IGNORE_INDEX


def evaluate(
    engine: Engine, inputs: torch.Tensor, targets: torch.Tensor, segments: torch.Tensor | None = None
) -> tuple[float, float | None]:
    """One batch (each data rank passes its own, of equal size), forward only in eval mode: (mean loss, accuracy)."""
    return evaluate_batches(engine, [(inputs, targets, segments)])


def evaluate_batches(
    engine: Engine,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
) -> tuple[float, float | None]:
    """Forward only, in eval mode (no dropout), stage by stage across the pipeline, over this data rank's
    ``(inputs, targets)`` batches (which may hold no examples), or ``(inputs, targets, segments)`` with
    document masking (segments None: none). Returns the mean loss over every counted
    target (image, or token not IGNORE_INDEX) of every data rank, and the accuracy (ViT)."""
    for stage in engine.stages.values():
        stage.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, counted targets
    try:
        for batch in batches:
            inputs, targets, *rest = batch
            segments = rest[0] if rest else None
            moved = None if segments is None else segments.to(engine.device)
            totals += _evaluate(engine, inputs.to(engine.device), targets.to(engine.device), moved)
    finally:
        for stage in engine.stages.values():
            stage.train()
    # Only the last stage's tp-rank-0 holds results (tp ranks hold equal copies); one all-reduce adds them up.
    if not (engine.holds_last_stage and engine.mesh.coord("tp") == 0):
        totals.zero_()
    totals = totals.to(engine.device)
    ops.all_reduce(totals)
    loss, correct, count = totals.tolist()
    return loss / count, (correct / count if engine.reports_accuracy else None)


def _evaluate(
    engine: Engine, inputs: torch.Tensor, targets: torch.Tensor, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """(loss sum, correct, counted targets) of one batch on the last stage; zeros elsewhere. The
    pipeline's forward-only program runs it, so any batch size works (an empty part still runs the
    stages, whose collectives its peers need, but scores nothing). Under cp each rank scores its chunks."""
    inputs, targets = engine.local_tokens(inputs), engine.local_tokens(targets)
    n, accuracy = int((targets != IGNORE_INDEX).sum()), engine.reports_accuracy

    def score(output: torch.Tensor) -> torch.Tensor:
        totals = torch.zeros(3, dtype=torch.float64)
        if n:  # the loss is the batch's mean over its counted targets
            totals[0] = float(engine.loss_fn(output, targets)) * n
            totals[1] = float((output.argmax(-1) == targets).sum()) if accuracy else 0.0
            totals[2] = n
        return totals

    result = engine.forward_only(inputs, score, segments)  # the whole batch is one microbatch here
    return result if result is not None else torch.zeros(3, dtype=torch.float64)
