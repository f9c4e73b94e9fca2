"""Direct Preference Optimization's loss (Rafailov et al., 2305.18290), as TRL's ``DPOTrainer`` computes it.

A microbatch holds pairs as adjacent rows: row 2k is pair k's chosen response, row 2k+1 its rejected
one, each after the same prompt; the labels are IGNORE_INDEX on the prompt and the padding, so a row's
log-probability is the sum over its completion tokens of log p(token | everything before it):

    logp(row) = sum_t log softmax(logits_t)[label_t]           (label_t != IGNORE_INDEX)
    chosen ratio r_c = logp_policy(chosen) - logp_ref(chosen), rejected ratio r_r likewise
    sigmoid: loss = -(1 - ls) log sigmoid(beta (r_c - r_r)) - ls log sigmoid(-beta (r_c - r_r))
    ipo:     loss = (r_c / n_c - r_r / n_r - 1 / (2 beta))^2    (n: completion tokens; TRL's normalisation)

and the step's loss is the mean over the pairs of the global batch. Every microbatch holds as many
pairs, so the mean of microbatch means (the pipeline executor's 1/m, data parallelism's average over
replicas) is that mean on any layout. The rewards TRL logs are beta x r_c and beta x r_r.

The reference's log-probs reach the loss inside the targets: :func:`pack_targets` appends each row's
(float64) to its labels, so the pipeline executor cuts both into microbatches together, and the pairs
stay with their reference numbers whatever the schedule. Under tp the log-softmax is the
vocabulary-parallel one of the language loss: no rank gathers the logits.

Shapes: B rows (2 x pairs), S positions, V the vocabulary (V/tp per rank under tp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.trainer.config import Config
from polyshard.trainer.config.dpo import DPOConfig
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.tasks.loss import IGNORE_INDEX, token_logps

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
"""What a DPO step logs, in TRL's names: the mean over the global batch's pairs of each."""


def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None, vocab_size: int
) -> torch.Tensor:
    """(B,) the sum over each row's counted labels of the label's log-probability, in float32 or wider:
    (B, S, V) logits, (B, S) labels (IGNORE_INDEX where a position counts nothing). Under tp ``logits``
    holds this rank's vocabulary columns and every tp rank gets the same sums."""
    return token_logps(logits, labels, tp_group, vocab_size).sum(dim=-1)


@dataclass(frozen=True)
class PairLosses:
    """Per pair (P = B / 2): the loss, and TRL's rewards beta x (policy - reference) log-ratio."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_losses(
    policy: torch.Tensor, reference: torch.Tensor, completion_tokens: torch.Tensor, config: DPOConfig
) -> PairLosses:
    """Each pair's loss from (B,) row log-probs of the policy and the reference, rows in (chosen,
    rejected) order, and (B,) each row's completion tokens (IPO's normalisation)."""
    reference = reference.to(policy.dtype)
    ratios = (policy - reference).view(-1, 2)  # (P, 2): chosen, rejected
    chosen, rejected = ratios[:, 0], ratios[:, 1]
    if config.loss == "ipo":
        tokens = completion_tokens.to(policy.dtype).clamp(min=1.0).view(-1, 2)
        delta = chosen / tokens[:, 0] - rejected / tokens[:, 1]
        losses = (delta - 1.0 / (2.0 * config.beta)) ** 2
    else:
        logits = config.beta * (chosen - rejected)
        smoothing = config.label_smoothing
        losses = -F.logsigmoid(logits) * (1.0 - smoothing) - F.logsigmoid(-logits) * smoothing
    return PairLosses(losses, config.beta * chosen.detach(), config.beta * rejected.detach())


def metric_sums(pairs: PairLosses) -> torch.Tensor:
    """(5,) float64 sums over the pairs: chosen rewards, rejected rewards, margins, accuracies, pairs; a
    step adds them over microbatches and ranks and divides by the pairs (:func:`metrics_of`)."""
    chosen, rejected = pairs.chosen_rewards.double(), pairs.rejected_rewards.double()
    return torch.stack(
        [
            chosen.sum(),
            rejected.sum(),
            (chosen - rejected).sum(),
            (chosen > rejected).double().sum(),  # TRL: a tie is not an accurate pair
            torch.tensor(float(chosen.numel()), dtype=torch.float64, device=chosen.device),
        ]
    )


def metrics_of(sums: torch.Tensor) -> dict[str, float]:
    """TRL's reward metrics from summed :func:`metric_sums`."""
    pairs = max(float(sums[4]), 1.0)
    return {name: float(value) / pairs for name, value in zip(METRICS, sums[:4].tolist())}


def pack_targets(labels: torch.Tensor, reference_logps: torch.Tensor) -> torch.Tensor:
    """(B, S + 1) float64: the (B, S) labels (exact: ids are far below 2^53) and each row's reference log-prob."""
    return torch.cat([labels.double(), reference_logps.double().unsqueeze(-1)], dim=-1)


def unpack_targets(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_targets` undone: ((B, S) int64 labels, (B,) float64 reference log-probs)."""
    return targets[:, :-1].long(), targets[:, -1]


class PreferenceLoss:
    """The last stage's loss on (logits, packed targets): the mean DPO loss of the microbatch's pairs.
    Each call adds the pairs' reward sums to :attr:`sums` (detached), which :meth:`take_sums` hands over
    and resets once per step."""

    def __init__(self, config: DPOConfig, tp_group: dist.ProcessGroup | None, vocab_size: int):
        self.config, self.tp_group, self.vocab_size = config, tp_group, vocab_size
        self.sums: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        labels, reference = unpack_targets(targets)
        policy = sequence_logps(logits, labels, self.tp_group, self.vocab_size)
        pairs = preference_losses(policy, reference, (labels != IGNORE_INDEX).sum(-1), self.config)
        sums = metric_sums(pairs)
        self.sums = sums if self.sums is None else self.sums + sums
        return pairs.losses.mean()

    def take_sums(self) -> torch.Tensor | None:
        sums, self.sums = self.sums, None
        return sums


def check_reference(config: Config, needed: bool = True, why: str = "training.task = 'dpo'") -> None:
    """The layouts the reference is built for (part of ``validate``); ``needed``: the run holds one
    (``why`` says what asks for it)."""
    if needed and config.parallel.zero_stage == 3 and config.lora is None:
        raise ConfigError(
            f"{why} keeps a frozen copy of the model as its reference, not built for "
            "parallel.zero_stage = 3 yet; use zero_stage 0-2 (or train LoRA adapters: the base is the reference)"
        )
