"""One optimizer step, read top to bottom in :func:`train_step`:

this data rank's batch -> pipeline forward/backward over microbatches (dp reduces once,
overlapped with the last backward) -> finish gradient reductions -> one global norm clip ->
optimizer step (skipped by every rank alike when the loss or the norm is not finite) -> the experts'
load of the step, and the routers' balancing bias moved by it (MoE models). What the step measured comes
back as one :class:`TrainStepResult`; nothing of it is left on the engine.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from polyshard.collectives import ops
from polyshard.models import output_width
from polyshard.pp import Timeline
from polyshard.trainer.config import Config
from polyshard.trainer.engine.balance import LayerLoad, balance_experts
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.engine.experts import keep_idle_experts
from polyshard.trainer.engine.gradient_norm import clip_to, local_squared_norm
from polyshard.trainer.engine.mtp import shifted_tokens
from polyshard.trainer.errors import DataError
from polyshard.trainer.tasks import task_for
from polyshard.trainer.tasks.loss import tokens_per_microbatch

Batch = Mapping[str, np.ndarray | torch.Tensor]  # a loader's rows (numpy), or tensors


@dataclass(frozen=True)
class TrainStepResult:
    """What one optimizer step measured, the same on every rank but ``timeline``."""

    loss: float
    """The global batch's loss: the mean over its counted target tokens (polyshard.trainer.tasks.loss)."""
    grad_norm: float
    """The global gradient norm before clipping."""
    mtp_losses: tuple[float, ...] = ()
    """Multi-token prediction: each depth's loss of the global batch, depth 1 first (empty without MTP)."""
    expert_load: Mapping[int, LayerLoad] = field(default_factory=dict)
    """MoE models: every MoE layer's load over the step's tokens, by pipeline layer (empty otherwise)."""
    timeline: Timeline | None = None
    """This rank's spans of the step, as the pipeline executor recorded them."""

    @property
    def finite(self) -> bool:
        """Whether the loss and the norm are finite: the optimizer stepped (else no rank did)."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def _tensors(batch: Batch) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v) for k, v in batch.items()}  # numpy rows are shared, not copied


def split_batch(config: Config, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A loader batch -> (inputs, targets), as the model's task cuts it. A token id the embedding has no
    row for (a shard damaged after the launcher's check) is a :class:`DataError`, not an IndexError."""
    tensors = _tensors(batch)
    tokens = tensors.get("tokens")
    vocab = output_width(config.model)
    if tokens is not None and tokens.numel() and int(tokens.max()) >= vocab:
        raise DataError(
            f"the data holds token id {int(tokens.max())}, past model.vocab_size={vocab}: a "
            "shard was changed or prepared with another tokenizer; prepare the data again with data.tokenizer"
        )
    return task_for(config).split_batch(tensors)


def batch_segments(config: Config, batch: Batch) -> torch.Tensor | None:
    """The inputs' document ids (B, S) with ``data.document_mask``, else None."""
    cut = task_for(config).input_segments
    return cut(_tensors(batch)) if config.data.document_mask and cut is not None else None


def _loss_part(engine: Engine, value: torch.Tensor | None) -> torch.Tensor:
    """This rank's part of the sum over replicas of ``value`` (float64, 0-d): the value on the one rank
    per replica that counts it (last stage, tp rank 0), else 0."""
    holder = engine.holds_last_stage and engine.mesh.coord("tp") == 0
    part = float(value) if holder and value is not None else 0.0
    return torch.tensor(part, dtype=torch.float64, device=engine.device)


def train_step(
    engine: Engine,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    lr: float,
    before_zero_grad: Callable[[], None] | None = None,
    segments: torch.Tensor | None = None,
) -> TrainStepResult:
    """One optimizer step on this data rank's batch: pipeline forward/backward over the microbatches,
    gradient reductions, one global-norm clip, AdamW. Returns what it measured (:class:`TrainStepResult`):
    the loss of the global batch (the mean over its counted target tokens, whichever rank and microbatch
    holds them), the gradient norm before clipping, the MTP depths' losses and the experts' load, the same
    on every rank, and this rank's timeline.

    Both numbers come out of one all-reduce, so every rank sees the same ones: when either is NaN or
    infinite, no rank updates (the step is skipped, as Megatron-LM does with an overflowing loss
    scale) and the caller decides whether to go on. No extra collective is needed to agree.
    ``before_zero_grad`` runs after the optimizer step while the gradients are still held (to measure them).
    ``segments``: the inputs' document ids, whole rows, with document masking (:func:`batch_segments`).
    """
    for optimizer in engine.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
    depths = len(engine.mtp_loss_fns)
    shifted = None
    if depths:  # multi-token prediction: cut from whole rows, then into this cp rank's chunks (engine.mtp)
        whole = shifted_tokens(inputs, targets, depths, None if segments is None else segments.to(inputs.device))
        shifted = (engine.local_tokens(whole[0]), engine.local_tokens(whole[1]))
    inputs, targets = engine.local_tokens(inputs), engine.local_tokens(targets)  # this cp rank's chunks
    replica_group = engine.replica_group  # every holder of a loss part
    microbatches = engine.num_microbatches
    # The losses divide by the global batch's counted tokens (one all-reduce each), told through the call.
    tokens = None
    if engine.loss_counts_tokens:  # not the ViT's
        tokens = tokens_per_microbatch(targets, replica_group, microbatches)
    mtp_tokens: list[float | None] = []
    if shifted is not None:  # made above whenever there are depths
        mtp_tokens = [tokens_per_microbatch(shifted[1][..., k], replica_group, microbatches) for k in range(depths)]
    ran = engine.forward_backward(inputs, targets, segments, shifted, tokens=tokens, mtp_tokens=mtp_tokens)
    engine.finish_gradients()
    gradients, tied_copies = engine.gradients()
    # One all-reduce over the world gives every rank both numbers (the squared norm's parts first, as
    # clip_grad_norm reduces them alone, then the loss's; each element is summed as it would be alone).
    squared_norm = local_squared_norm(gradients, engine.mesh.layout.as_dict()).to(engine.device)
    parts = [squared_norm, _loss_part(engine, ran.loss)]
    if depths:  # each depth's loss, the mean over microbatches (as the executor's loss), summed like it
        taken = engine.take_mtp_losses()
        parts += [_loss_part(engine, None if taken is None else taken[k] / microbatches) for k in range(depths)]
    sums = torch.stack(parts)
    ops.all_reduce(sums)
    grad_norm, loss = float(sums[0].sqrt()), float(sums[1]) / engine.replicas
    mtp_losses = tuple(float(v) / engine.replicas for v in sums[2:])
    clip_to(grad_norm, engine.config.optimizer.grad_clip, [g for g, _ in gradients], tied_copies)
    stepped = math.isfinite(loss) and math.isfinite(grad_norm)  # TrainStepResult.finite
    if stepped:
        # optimizer.idle_experts = "skip": experts no rank routed a token to come out of the step unchanged;
        # "step" (the default): AdamW steps them with their zero gradient, as one stacked tensor.
        skip_idle = engine.config.optimizer.idle_experts == "skip"
        with keep_idle_experts(engine) if skip_idle else contextlib.nullcontext():
            for optimizer in engine.optimizers:
                optimizer.step()
    expert_load: dict[int, LayerLoad] = {}
    if engine.has_experts:  # the step's load over every token; sigmoid routers rebalance
        expert_load = balance_experts(engine, stepped)
    if before_zero_grad is not None:
        before_zero_grad()
    engine.zero_grad()
    return TrainStepResult(loss, grad_norm, mtp_losses, expert_load, ran.timeline)
