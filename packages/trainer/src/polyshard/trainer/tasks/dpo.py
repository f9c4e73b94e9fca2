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

The reference's log-probs reach the loss inside the targets: :func:`pack_targets` sets each row's
(float64) beside every one of its labels, so the pipeline executor cuts both into microbatches together
(the pairs stay with their reference numbers whatever the schedule) and cp cuts both along the sequence
(every chunk of a row still carries the row's number). Under tp the log-softmax is the
vocabulary-parallel one of the language loss: no rank gathers the logits.

Under context parallelism (cp ranks, :mod:`polyshard.trainer.engine.context`) each rank holds two
load-balanced chunks of every row, so it sums only its chunks' completion tokens: a part p_r of each
row's log-prob, logp = p_1 + ... + p_cp. The pair loss needs the whole sums, so :func:`whole_row_sums`
adds the parts up over the cp group (with the completion-token counts, for IPO), and every cp rank then
computes the same loss L of the same pairs. Its gradient:

    forward:  logp = all-reduce(p_r) over cp         every cp rank holds the whole sums, and the same L
    backward: dp_r = all-reduce(g_s) over cp = cp g   g = dL/dlogp, the same on every cp rank

Why the sum of the cp ranks' gradients, not g alone: the cp ranks are replicas of the parameters, and
data parallelism averages the gradients over all R = dp x cp of them (as it does the language loss's
token sums). Rank r's parameter gradient is cp g dp_r/dtheta; the average over its cp group is
g (dp_1 + ... + dp_cp)/dtheta = dL/dtheta, and the average over dp that of the pair mean. Each rank's
loss *value* stays L, so train_step's sum of the replicas' losses over R reports L as well. Worked
example, cp=2, one pair with rows split 3 + 2 and 1 + 4 completion tokens: rank 0 holds p = (a0, b0),
rank 1 (a1, b1); both compute L(a0 + a1, b0 + b1); rank 0's gradient reaches a0's tokens as 2 dL/dlogp_c,
rank 1's a1's tokens likewise; halved by the cp average, each token gets dL/dlogp_c, as on one process.
The reference's parts are added up the same way, forward only (:mod:`polyshard.trainer.loop.preferences`),
and the reward metrics count each pair on cp rank 0 only.

Shapes: B rows (2 x pairs), S positions (2C: a rank's two chunks under cp), V the vocabulary (V/tp per
rank under tp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.collectives import ops
from polyshard.trainer.config.dpo import DPOConfig
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


class _SumOverContext(torch.autograd.Function):
    """forward: all-reduce (sum) over the cp group / backward: all-reduce (sum) over the cp group (the
    module's docstring works the factor cp through)."""

    @staticmethod
    def forward(ctx: Any, parts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        whole = parts.contiguous().clone()
        ops.all_reduce(whole, group)
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        ops.all_reduce(grad, ctx.group)
        return grad, None


def whole_row_sums(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int,
    cp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """((B,) each row's completion log-prob, (B,) its completion tokens) of whole rows. Under cp
    ``logits`` (B, 2C, V) and ``labels`` (B, 2C) are this rank's chunks of the rows and one all-reduce
    over ``cp_group`` adds every rank's parts (differentiable: :class:`_SumOverContext`)."""
    policy = sequence_logps(logits, labels, tp_group, vocab_size)
    tokens = (labels != IGNORE_INDEX).sum(-1)
    if cp_group is None:
        return policy, tokens
    stacked = torch.stack([policy, tokens.to(policy.dtype)], dim=-1)
    both = _SumOverContext.apply(stacked, cp_group)  # type: ignore[no-untyped-call]  # (B, 2)
    return both[:, 0], both[:, 1].detach().round().long()


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
    """(B, S, 2) float64: the (B, S) labels (exact: ids are far below 2^53) and beside each one its row's
    reference log-prob, so a cut along the rows (microbatches) or the sequence (cp chunks) keeps both."""
    reference = reference_logps.double().unsqueeze(-1).expand(labels.shape)
    return torch.stack([labels.double(), reference], dim=-1)


def unpack_targets(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_targets` undone (any rows and chunks of it): ((B, S) int64 labels, (B,) float64
    reference log-probs)."""
    return targets[..., 0].long(), targets[:, 0, 1]


class PreferenceLoss:
    """The last stage's loss on (logits, packed targets): the mean DPO loss of the microbatch's pairs.
    Each call adds the pairs' reward sums to :attr:`sums` (detached), which :meth:`take_sums` hands over
    and resets once per step. :attr:`cp_group` (None without cp) is set by the run
    (:class:`polyshard.trainer.loop.preferences.PreferenceRun`): a task's loss is built knowing only tp."""

    def __init__(
        self,
        config: DPOConfig,
        tp_group: dist.ProcessGroup | None,
        vocab_size: int,
        cp_group: dist.ProcessGroup | None = None,
    ):
        self.config, self.tp_group, self.vocab_size, self.cp_group = config, tp_group, vocab_size, cp_group
        self.sums: torch.Tensor | None = None

    def pair_losses(self, logits: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor) -> PairLosses:
        """The pairs' losses from this rank's logits and labels (its cp chunks) and the rows' whole
        reference log-probs."""
        policy, tokens = whole_row_sums(logits, labels, self.tp_group, self.vocab_size, self.cp_group)
        return preference_losses(policy, reference, tokens, self.config)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pairs = self.pair_losses(logits, *unpack_targets(targets))
        sums = metric_sums(pairs)
        self.sums = sums if self.sums is None else self.sums + sums
        return pairs.losses.mean()

    def take_sums(self) -> torch.Tensor | None:
        sums, self.sums = self.sums, None
        return sums
