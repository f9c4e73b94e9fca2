"""What a DPO run adds to the training loop (:class:`~polyshard.trainer.loop.Trainer` calls it):

* before each step, the reference's log-probs of this data rank's rows, packed into the targets the
  pipeline cuts into microbatches (:func:`polyshard.trainer.tasks.dpo.pack_targets`);
* after each step, TRL's reward metrics over the global batch's pairs (one all-reduce of five numbers);
* evaluation: the mean DPO loss and the rewards over the validation pairs, forward only.

Under cp the reference, like the policy, runs on this rank's chunks of the rows; one all-reduce over the
cp group adds the chunks' log-prob parts into each row's whole (forward only, no gradient), and the
reward sums count on cp rank 0 alone (every cp rank computes the same pairs; :mod:`polyshard.trainer.tasks.dpo`).

With ``dpo.reference = "precomputed"`` the reference runs only before the first step, over every pair
(:mod:`polyshard.trainer.loop.reference_logps`), and is dropped; each step then packs the stored numbers of
the pairs its batch holds (the batch's ``pair`` column), and a resumed run reads them back from the run folder.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import cast

import numpy as np
import torch

from polyshard.collectives import ops
from polyshard.data.loader import ShardedLoader
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.loop import reference_logps
from polyshard.trainer.loop.reference import Reference
from polyshard.trainer.loop.step import Batch, split_batch
from polyshard.trainer.tasks.dpo import (
    METRICS,
    PreferenceLoss,
    metric_sums,
    metrics_of,
    pack_targets,
)

Pairs = np.ndarray | torch.Tensor | None  # a batch's pair numbers within its set


class PreferenceRun:
    """DPO's part of a run on ``engine``, whose weights are the starting ones (built before any step);
    ``loaders`` (training, validation) and ``out``, the run folder, serve a precomputed reference."""

    def __init__(
        self,
        engine: Engine,
        start: int,
        loaders: tuple[ShardedLoader, ShardedLoader],
        out: Path,
        reference: Reference | None = None,
    ):
        self.engine = engine
        self.loss = cast(PreferenceLoss, engine.loss_fn)
        self.cp_group = engine.cp_group
        self.loss.cp_group = self.cp_group  # the loss adds its rows' parts over cp (tasks.dpo.whole_row_sums)
        self.reference: Reference | None = None
        self.stored: reference_logps.StoredLogps | None = None
        dpo = engine.config.dpo
        if dpo is not None and dpo.reference == "precomputed":
            if start > 0:
                self.stored = reference_logps.load(engine, loaders, self._holder, out)
            else:  # the reference lives for this pass alone: training holds no copy of it
                self.reference = Reference(engine)
                self.stored = reference_logps.compute(engine, loaders, self._holder, self._reference_logps, out)
                self.reference = None
            return
        # A resumed run's reference was rebuilt from the starting weights its checkpoint names (loop.reference_start).
        self.reference = reference or Reference(engine)

    @property
    def _holder(self) -> bool:
        """The one rank per data rank whose sums count (last stage, tp rank 0, cp rank 0): tp and cp ranks
        compute the same pairs."""
        mesh = self.engine.mesh
        return self.engine.holds_last_stage and mesh.coord("tp") == 0 and mesh.coord("cp") == 0

    def targets(self, inputs: torch.Tensor, labels: torch.Tensor, pairs: Pairs = None) -> torch.Tensor:
        """This data rank's whole (B, S) labels with each row's reference log-prob beside them (on the last
        stage; elsewhere unused): train_step cuts both into this cp rank's chunks. ``pairs``: the batch's
        pair numbers (its ``pair`` column), which a precomputed reference needs."""
        reference = self._logps(inputs, labels, pairs, val=False)
        return labels if reference is None else pack_targets(labels, reference)

    def _logps(self, inputs: torch.Tensor, labels: torch.Tensor, pairs: Pairs, val: bool) -> torch.Tensor | None:
        """(B,) the reference's log-prob of each row on the last stage's ranks, else None: stored, or computed."""
        if self.stored is None:
            return self._reference_logps(inputs, labels)
        if not self.engine.holds_last_stage:
            return None
        if pairs is None:
            raise RuntimeError("a batch of a precomputed DPO run names no pairs (its 'pair' column)")
        table = self.stored.val if val else self.stored.train
        # (P, 2) -> 2P rows, chosen then rejected of each pair: the order the task lays the rows in
        return table[torch.as_tensor(pairs).long().cpu()].reshape(-1).to(self.engine.device)

    def _reference_logps(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """(B,) each whole row's completion log-prob under the reference on the last stage's ranks, else
        None; ``inputs``, ``labels``: whole rows. Under cp the reference runs on this rank's chunks and
        the parts are added up over the cp group (whose ranks all hold the last stage, or none does)."""
        if self.reference is None:
            raise RuntimeError("the reference was dropped after its log-probs were precomputed")
        local = self.engine.local_tokens
        reference = self.reference.logps(local(inputs), local(labels))
        if reference is not None and self.cp_group is not None:
            ops.all_reduce(reference, self.cp_group)
        return reference

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
                found = self._evaluate(inputs, labels, part.get("pair"))
                if found is not None:
                    total += found
        finally:
            for stage in stages:
                stage.train()
        total = self._reduced(total if self._holder else None, len(METRICS) + 2)
        figures = {"val_loss": float(total[0]) / max(float(total[-1]), 1.0)}
        figures.update({f"val_{name}": value for name, value in metrics_of(total[1:]).items()})
        return figures

    def _evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, pairs: Pairs) -> torch.Tensor | None:
        reference = self._logps(inputs, labels, pairs, val=True)
        local_labels = self.engine.local_tokens(labels)
        loss = self.loss

        def score(logits: torch.Tensor) -> torch.Tensor:
            if reference is None:  # the rank holding the last stage computes both
                raise RuntimeError("the reference gave no log-probs on the rank holding the last stage")
            pairs = loss.pair_losses(logits, local_labels, reference)
            return torch.cat([pairs.losses.double().sum().reshape(1).cpu(), metric_sums(pairs).cpu()])

        return self.engine.forward_only(self.engine.local_tokens(inputs), score)
