"""Group Relative Policy Optimization's advantages and loss (DeepSeekMath, 2402.03300), as TRL 1.16's
``GRPOTrainer`` computes them, with its normalisations (DAPO 2503.14476, Dr. GRPO 2503.20783).

Each prompt is completed ``generations`` times, a group of adjacent rows. A completion's reward is the
weighted sum of its reward functions' scores (:func:`polyshard.trainer.tasks.rewards.total_rewards`);
its advantage compares it with its group (:func:`group_advantages`):

    A_i = (r_i - mean of its group) / (std + 1e-4)    std: its group's, the batch's, or none (A = r - mean)

Per completion token t, with the log-probs of logits / temperature (TRL's), the policy's log p_t, the
generating policy's log p_old,t (its own detached value when ``iterations`` = 1, as TRL), the reference's
log p_ref,t:

    ratio_t = exp(log p_t - log p_old,t)
    loss_t  = -min(ratio_t A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t
    kl_t    = (exp(log p_ref,t - log p_t) - (log p_ref,t - log p_t) - 1) x ratio_t   (only when beta > 0)

(k3, times the ratio with its gradient unless ``use_bias_correction_kl`` is off: TRL 1.16's default, so
the KL's gradient differs from plain k3's even on-policy, where the ratio is 1)

and the step's loss averages the completion tokens' loss_t as ``loss_type`` says, over the global batch
(G completions, N completion tokens, L = max_completion_length):

    dapo:    sum of every loss_t / N                       (TRL 1.16's default)
    grpo:    mean over completions of (sum of its loss_t / its tokens)
    dr_grpo: sum of every loss_t / (G x L)
    bnpo:    per microbatch, its loss_t summed / its tokens; the mean over microbatches and replicas

On the mesh, the pipeline executor divides each microbatch's loss by m microbatches and data parallelism
averages over R replicas (dp x ep x cp), so a microbatch divides its sum by the global count / (R x m),
the *normaliser* (:func:`loss_normaliser`, as :class:`~polyshard.trainer.tasks.loss.TokenMeanLoss`): N / (R m)
for dapo (one all-reduce), the rows per microbatch for grpo (each row counts its own token mean), rows x L
for dr_grpo. These give the same loss on any layout: dp=2, m=2 and 12 completion tokens in all, dapo's
microbatches divide by 12 / 4 = 3, and (s_1/3 + s_2/3)/2 and (s_3/3 + s_4/3)/2 average to (s_1+...+s_4)/12.
bnpo is TRL's per-device token mean: here each microbatch's own, so like TRL's it changes with the
microbatch size (one microbatch per replica: the replica's tokens).

The log-probs and advantages reach the loss inside the targets (:func:`pack_targets`), so the pipeline
executor cuts them into microbatches with the labels. Under tp the log-softmax is vocabulary-parallel. The
old and reference log-probs are :func:`token_logps` with ``temperature=grpo.temperature`` too (TRL scales
every model's logits alike), else the first ratio is not 1.

Shapes: B rows (completions, prompt tokens included, IGNORE_INDEX labels on the prompt and padding),
S positions, V the vocabulary (V/tp per rank under tp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from polyshard.trainer.config.grpo import GRPOConfig
from polyshard.trainer.tasks.loss import IGNORE_INDEX, token_logps, tokens_per_microbatch
from polyshard.trainer.tasks.rewards import nanstd

__all__ = [
    "METRICS",
    "GRPOLoss",
    "GRPOTargets",
    "group_advantages",
    "loss_normaliser",
    "metrics_of",
    "pack_targets",
    "token_logps",
    "unpack_targets",
    "zero_std_fraction",
]

STD_EPSILON = 1e-4  # TRL's: advantages / (std + 1e-4), so a group of equal rewards gets 0, not NaN
METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")
"""What a GRPO step logs from the loss, in TRL's names: shares of the completion tokens, and their mean KL."""
HEADER = 3  # a packed row's leading columns: advantage, normaliser, which optional log-probs follow


def group_advantages(
    rewards: torch.Tensor, generations: int, scale_rewards: str, *, batch_rewards: torch.Tensor | None = None
) -> torch.Tensor:
    """(B,) TRL's advantages of (B,) rewards, B = prompts x ``generations`` in group order (NaN: a
    completion no function scored: left out of the means and stds, advantage 0). A group's rows lie on
    one data rank, so ``rewards`` may be this rank's; 'batch' scaling divides by the std of the whole
    generation batch, ``batch_rewards`` (every data rank's rewards: the caller all-gathers them, as TRL
    gathers over processes; None: ``rewards`` is the whole batch)."""
    grouped = rewards.view(-1, generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(generations)
    if scale_rewards == "batch":
        std = nanstd(rewards if batch_rewards is None else batch_rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)


def zero_std_fraction(rewards: torch.Tensor, generations: int, scale_rewards: str) -> float:
    """TRL's ``frac_reward_zero_std``: the share of completions whose std (group's, or the batch's) is 0,
    i.e. whose group teaches nothing."""
    std = nanstd(rewards) if scale_rewards == "batch" else nanstd(rewards.view(-1, generations), dim=1)
    return float(torch.isclose(std, torch.zeros_like(std)).double().mean())


@dataclass(frozen=True)
class GRPOTargets:
    """One microbatch's targets: (B, S) labels, the (B, S) log-probs of the generating policy and of the
    reference when given, (B,) advantages, and the normaliser (a 0-d tensor)."""

    labels: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    advantages: torch.Tensor
    normaliser: torch.Tensor


def pack_targets(
    labels: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    normaliser: float,
) -> torch.Tensor:
    """(B, 3 + S x (1 + given log-probs)) float64: per row its advantage, the normaliser, a code of which
    log-probs follow (1: old, 2: reference, 3: both), then the labels (exact: ids are far below 2^53) and
    the given (B, S) log-probs (float32 values, exact in float64)."""
    rows = labels.shape[0]
    given = [t for t in (old_logps, ref_logps) if t is not None]
    code = (old_logps is not None) + 2 * (ref_logps is not None)
    header = torch.stack(
        [
            advantages.double(),
            torch.full((rows,), float(normaliser), dtype=torch.float64, device=labels.device),
            torch.full((rows,), float(code), dtype=torch.float64, device=labels.device),
        ],
        dim=1,
    )
    return torch.cat([header, labels.double(), *(t.double() for t in given)], dim=1)


def unpack_targets(targets: torch.Tensor) -> GRPOTargets:
    """:func:`pack_targets` undone (any rows of it: a microbatch)."""
    code = int(targets[0, 2])
    width = (targets.shape[1] - HEADER) // (1 + (code & 1) + (code >> 1))
    parts = iter(targets[:, HEADER:].split(width, dim=1))
    labels = next(parts).long()
    old = next(parts) if code & 1 else None
    ref = next(parts) if code & 2 else None
    return GRPOTargets(labels, old, ref, targets[:, 0], targets[0, 1])


def loss_normaliser(
    config: GRPOConfig, labels: torch.Tensor, replica_group: dist.ProcessGroup | None, num_microbatches: int
) -> float:
    """What each microbatch's summed loss divides by (see the module's docstring), from this data rank's
    (B, S) labels: dapo N / (R m) (one all-reduce of one number over ``replica_group``; None: one replica,
    no collective); grpo the rows per microbatch; dr_grpo those x max_completion_length; bnpo 1.0 (unused:
    a microbatch counts its own)."""
    if config.loss_type == "dapo":
        if replica_group is None:
            return max(float((labels != IGNORE_INDEX).sum()), 1.0) / num_microbatches
        return tokens_per_microbatch(labels, replica_group, num_microbatches)
    rows = labels.shape[0] / num_microbatches  # every replica holds as many rows
    if config.loss_type == "grpo":
        return rows
    if config.loss_type == "dr_grpo":
        return rows * config.max_completion_length
    return 1.0


class GRPOLoss:
    """The last stage's loss on (logits, packed targets): the microbatch's clipped-objective loss, scaled so
    that the executor's mean over microbatches and the replicas' average give the global batch's loss.
    Each call adds the clip, KL and token sums to :attr:`sums` (detached), which :meth:`take_sums` hands
    over and resets once per step."""

    sums_size = 6
    """The length of :attr:`sums`: what a step all-reduces when a rank holds none (zeros)."""

    def __init__(self, config: GRPOConfig, tp_group: dist.ProcessGroup | None, vocab_size: int):
        self.config, self.tp_group, self.vocab_size = config, tp_group, vocab_size
        self.sums: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        found = unpack_targets(targets)
        logps = token_logps(logits, found.labels, self.tp_group, self.vocab_size, temperature=self.config.temperature)
        mask = found.labels != IGNORE_INDEX
        per_token, ratio, kl = self.token_losses(logps, found, mask)
        weights = mask.to(per_token.dtype)
        sums = self._metric_sums(ratio, kl, found.advantages.to(ratio.dtype).unsqueeze(1), mask)
        self.sums = sums if self.sums is None else self.sums + sums
        kind = self.config.loss_type
        if kind == "bnpo":
            return (per_token * weights).sum() / weights.sum().clamp(min=1.0)
        normaliser = found.normaliser.to(per_token.dtype)
        if kind == "grpo":
            per_row = (per_token * weights).sum(-1) / weights.sum(-1).clamp(min=1.0)
            return per_row.sum() / normaliser
        return (per_token * weights).sum() / normaliser  # dapo, dr_grpo

    def token_losses(
        self, logps: torch.Tensor, found: GRPOTargets, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(B, S) each token's loss, its probability ratio (detached) and its KL to the reference (None
        without beta) from the policy's (B, S) log-probs. Positions outside ``mask`` hold finite values."""
        config = self.config
        if found.old_logps is None and config.iterations > 1:
            raise RuntimeError("grpo.iterations > 1 needs the generating policy's log-probs in the targets")
        old = logps.detach() if found.old_logps is None else found.old_logps.to(logps.dtype).masked_fill(~mask, 0.0)
        ratio = torch.exp(logps - old)
        clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.upper_epsilon)
        advantages = found.advantages.to(logps.dtype).unsqueeze(1)  # (B, 1)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        kl = None
        if config.beta != 0.0:
            if found.ref_logps is None:
                raise RuntimeError("grpo.beta > 0 needs the reference's log-probs in the targets")
            delta = found.ref_logps.to(logps.dtype).masked_fill(~mask, 0.0) - logps
            kl = torch.exp(delta) - delta - 1
            if config.use_bias_correction_kl:
                kl = kl * ratio  # the ratio with its gradient, as TRL's coef_1
            per_token = per_token + config.beta * kl
        return per_token, ratio.detach(), None if kl is None else kl.detach()

    def _metric_sums(
        self, ratio: torch.Tensor, kl: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """(6,) float64 over the completion tokens: clipped low, clipped high, either (TRL's clip_ratio
        counts), the KL's sum, the tokens, the rows; a step adds them over microbatches and replicas."""
        low = (ratio < 1 - self.config.epsilon) & (advantages < 0) & mask
        high = (ratio > 1 + self.config.upper_epsilon) & (advantages > 0) & mask
        rows = torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device)
        kl_sum = torch.zeros_like(rows) if kl is None else (kl.double() * mask).sum()
        counts = [low.sum(), high.sum(), (low | high).sum(), kl_sum, mask.sum(), rows]
        return torch.stack([c.double() for c in counts])

    def take_sums(self) -> torch.Tensor | None:
        sums, self.sums = self.sums, None
        return sums

    def metrics_of(self, sums: torch.Tensor) -> dict[str, float]:
        """:func:`metrics_of` the summed :meth:`take_sums`, the KL when beta > 0 (as TRL logs it)."""
        return metrics_of(sums, with_kl=self.config.beta != 0.0)


def metrics_of(sums: torch.Tensor, *, with_kl: bool) -> dict[str, float]:
    """TRL's loss metrics from summed :meth:`GRPOLoss.take_sums`: the clipped shares of the completion
    tokens, the mean KL (``with_kl``: beta > 0, as TRL logs it), and the completion tokens per row."""
    tokens = max(float(sums[4]), 1.0)
    figures = {name: float(sums[i]) / tokens for i, name in enumerate(METRICS[:3])}
    if with_kl:
        figures["kl"] = float(sums[3]) / tokens
    figures["completions/mean_length"] = float(sums[4]) / max(float(sums[5]), 1.0)
    return figures
