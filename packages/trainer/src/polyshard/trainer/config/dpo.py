"""The ``[dpo]`` section: preference training (Direct Preference Optimization, 2305.18290) with
``training.task = "dpo"``. Its names are TRL's ``DPOConfig``'s (``beta``, ``loss_type`` is ``loss``,
``label_smoothing``), so a recipe carries over; the loss is :mod:`polyshard.trainer.tasks.dpo`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

from polyshard.models.errors import ConfigError

DPO_LOSSES = ("sigmoid", "ipo")  # TRL's loss_type: DPO's logistic loss, IPO's squared one (2310.12036)
REFERENCES = ("model", "precomputed")


@dataclass(kw_only=True, frozen=True)
class DPOConfig:
    beta: float = 0.1
    """How far the policy may move from the reference: the rewards are beta x the log-ratio (TRL's 0.1);
    IPO's tau (its target margin is 1 / (2 beta))."""
    loss: str = "sigmoid"
    """'sigmoid': -log sigmoid(beta x margin) (DPO); 'ipo': (margin / completion tokens - 1 / (2 beta))^2,
    the margin of per-token means as TRL normalises IPO."""
    label_smoothing: float = 0.0
    """With loss = 'sigmoid': the chance that a pair's labels are flipped (conservative DPO): the loss is
    (1 - ls) x -log sigmoid(beta m) + ls x -log sigmoid(-beta m). In [0, 0.5)."""
    reference: str = "model"
    """'model': a frozen copy of the starting weights, laid out like the model on every rank (no gradients,
    no optimizer state; with LoRA the base with adapters off); 'precomputed': before the first step that
    copy computes every training and validation pair's log-probs once, in the run's own batches, into
    ``<out>/reference_logps.safetensors``, and is dropped: no copy during training, and the run resumes."""

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float) or not math.isfinite(self.beta):
            raise ConfigError(f"dpo.beta={self.beta!r} must be a number > 0, e.g. 0.1")
        if self.beta <= 0:
            raise ConfigError(f"dpo.beta={self.beta!r} must be > 0, e.g. 0.1 (TRL's default)")
        if self.loss not in DPO_LOSSES:
            raise ConfigError(f"dpo.loss={self.loss!r} must be one of {list(DPO_LOSSES)}")
        smoothing = self.label_smoothing
        if isinstance(smoothing, bool) or not isinstance(smoothing, int | float) or not 0.0 <= smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing={smoothing!r} must be in [0, 0.5), e.g. 0 or 0.1")
        if smoothing and self.loss != "sigmoid":
            raise ConfigError(
                f"dpo.label_smoothing={smoothing} applies to loss = 'sigmoid' only (got loss={self.loss!r}); "
                "set it to 0"
            )
        if self.reference not in REFERENCES:
            raise ConfigError(f"dpo.reference={self.reference!r} must be one of {list(REFERENCES)}")
