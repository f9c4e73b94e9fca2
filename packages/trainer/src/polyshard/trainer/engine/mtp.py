"""Multi-token prediction on this rank's stages: each microbatch's shifted tokens reach the last stage.

A model with ``model.mtp_depth`` = D > 0 holds its prediction depths in the output head's layer
(:mod:`polyshard.models.common.mtp`), so they run on the last pipeline stage. Depth k at position i reads
the input token k places ahead and predicts the target k places ahead (token i + k + 1). Every rank
builds its own loader batch, so the last stage cuts both from whole rows itself (:func:`shifted_tokens`):
nothing new travels between stages, as with document masks (:mod:`.documents`).

Where depth k's target does not exist it is the ignore index, so it counts for nothing:

* the last k positions of a row (their token k ahead is past the row; torchtitan and Megatron-Core
  drop them alike);
* with document masks, a position whose token k ahead lies in another document: depth k predicts within
  the document, and as the main loss does, the last token read may be the document's end and its target
  the next document's first token (the main loss: input i, target i + 1; depth k: input i + k, target
  i + k + 1).

Context parallelism: the shifted rows are cut into this rank's chunks like the tokens (chunks r and
2 cp - 1 - r), from whole rows, so a position whose token k ahead sits in another rank's chunk reads it
from the row every rank holds: no exchange at chunk borders and nothing masked there (only at the row's
end, as without cp). The depths' attention runs over cp like the blocks'.

Each depth's loss is the mean over its counted targets of the global batch, divided as the main loss
is (:func:`polyshard.trainer.tasks.loss.tokens_per_microbatch`, one count per depth).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from polyshard.models.anatomy import multi_token_predictions
from polyshard.models.common.mtp import MultiTokenPrediction, PredictionInputs
from polyshard.trainer.tasks.loss import IGNORE_INDEX, TokenMeanLoss


def shifted_tokens(
    inputs: torch.Tensor, targets: torch.Tensor, depth: int, segments: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole rows (B, S) -> each depth's (inputs, targets), (B, S, D): ``[:, i, k - 1]`` holds
    ``inputs[:, i + k]`` and ``targets[:, i + k]``; past the row (and, with ``segments``, across a
    document border) the input is 0 and the target ``IGNORE_INDEX``."""
    rows, length = inputs.shape
    ahead = torch.zeros(rows, length, depth, dtype=inputs.dtype, device=inputs.device)
    wanted = torch.full((rows, length, depth), IGNORE_INDEX, dtype=targets.dtype, device=targets.device)
    for k in range(1, min(depth, length - 1) + 1):
        ahead[:, : length - k, k - 1] = inputs[:, k:]
        kept = targets[:, k:]
        if segments is not None:  # the token k ahead is in another document: no target
            kept = kept.masked_fill(segments[:, k:] != segments[:, : length - k], IGNORE_INDEX)
        wanted[:, : length - k, k - 1] = kept
    return ahead, wanted


def prediction_modules(stages: Mapping[int, nn.Module]) -> dict[int, MultiTokenPrediction]:
    """This rank's prediction depths (one module, in the last stage's head), by stage index."""
    return {index: module for index, stage in stages.items() for module in multi_token_predictions(stage)}


def microbatch_predictions(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    losses: Sequence[TokenMeanLoss],
    counts: Sequence[float | None],
    num_microbatches: int,
) -> list[PredictionInputs]:
    """Each microbatch's :class:`PredictionInputs` for the last stage's head: its chunk of the shifted rows
    (the executor's microbatch k is chunk k of the batch along dim 0) and a loss per depth that divides
    by ``counts[k]``, the step's counted tokens per microbatch of depth k (:func:`tokens_per_microbatch`)."""

    def loss(outputs: torch.Tensor, wanted: torch.Tensor, depth: int) -> torch.Tensor:
        return losses[depth](outputs, wanted, counts[depth])

    parts = zip(inputs.chunk(num_microbatches), targets.chunk(num_microbatches))
    return [PredictionInputs(ahead, wanted, loss) for ahead, wanted in parts]
