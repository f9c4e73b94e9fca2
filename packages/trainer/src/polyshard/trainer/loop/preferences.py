"""What a DPO run adds to the training loop (:class:`~polyshard.trainer.loop.Trainer` calls it):

* before each step, the reference's log-probs of this data rank's rows, packed into the targets the
  pipeline cuts into microbatches (:func:`polyshard.trainer.tasks.dpo.pack_targets`);
* after each step, TRL's reward metrics over the global batch's pairs (one all-reduce of five numbers);
* evaluation: the mean DPO loss and the rewards over the validation pairs, forward only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch

from polyshard.collectives import ops
from polyshard.trainer.engine.runtime import Engine
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop.reference import Reference
from polyshard.trainer.loop.step import Batch, split_batch
from polyshard.trainer.tasks.dpo import (
    METRICS,
    PreferenceLoss,
    metric_sums,
    metrics_of,
    pack_targets,
    preference_losses,
    sequence_logps,
)
from polyshard.trainer.tasks.loss import IGNORE_INDEX


class PreferenceRun:
    """DPO's part of a run on ``engine``, whose weights are the starting ones (built before any step)."""

    def __init__(self, engine: Engine, start: int):
        if start > 0:
            raise ConfigError(
                f"a DPO run does not resume yet (this one would continue from step {start}): its reference, the "
                "starting weights, is not in the checkpoint; start it again with --overwrite"
            )
        self.engine = engine
        self.reference = Reference(engine)
        self.loss = cast(PreferenceLoss, engine.executor.loss_fn)

    @property
    def _holder(self) -> bool:
        """The one rank per replica whose loss sums count (last stage, tp rank 0), as train_step's loss."""
        return self.engine.holds_last_stage and self.engine.mesh.coord("tp") == 0

    def targets(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This data rank's labels with each row's reference log-prob (on the last stage; elsewhere unused).
        Whole rows: DPO refuses cp, so no rank holds a chunk of a sequence."""
        reference = self.reference.logps(inputs, labels)
        return labels if reference is None else pack_targets(labels, reference)

    def step_metrics(self) -> dict[str, float]:
        """The last step's rewards over the global batch's pairs (collective: every rank calls it)."""
        sums = self.loss.take_sums()
        return metrics_of(self._reduced(sums if self._holder else None, len(METRICS) + 1))

    def _reduced(self, sums: torch.Tensor | None, size: int) -> torch.Tensor:
        part = torch.zeros(size, dtype=torch.float64) if sums is None else sums.detach().double().cpu()
        part = part.to(self.engine.device)
        ops.all_reduce(part)
        return part.cpu()

    def evaluate(self, parts: Iterable[Batch]) -> dict[str, float]:
        """The validation pairs' mean DPO loss and rewards, forward only in eval mode."""
        stages = self.engine.stages.values()
        for stage in stages:
            stage.eval()
        total = torch.zeros(len(METRICS) + 2, dtype=torch.float64)  # loss sum, then metric_sums
        try:
            for part in parts:
                inputs, labels = (t.to(self.engine.device) for t in split_batch(self.engine.config, part))
                found = self._evaluate(inputs, labels)
                if found is not None:
                    total += found
        finally:
            for stage in stages:
                stage.train()
        total = self._reduced(total if self._holder else None, len(METRICS) + 2)
        figures = {"val_loss": float(total[0]) / max(float(total[-1]), 1.0)}
        figures.update({f"val_{name}": value for name, value in metrics_of(total[1:]).items()})
        return figures

    def _evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        reference = self.reference.logps(inputs, labels)
        loss = self.loss

        def score(logits: torch.Tensor) -> torch.Tensor:
            if reference is None:  # the rank holding the last stage computes both
                raise RuntimeError("the reference gave no log-probs on the rank holding the last stage")
            policy = sequence_logps(logits, labels, loss.tp_group, loss.vocab_size)
            pairs = preference_losses(policy, reference, (labels != IGNORE_INDEX).sum(-1), loss.config)
            return torch.cat([pairs.losses.double().sum().reshape(1).cpu(), metric_sums(pairs).cpu()])

        return self.engine.forward_only(inputs, score)
