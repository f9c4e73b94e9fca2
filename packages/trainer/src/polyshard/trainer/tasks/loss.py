"""The language-model loss: the mean over the counted target tokens of the whole global batch.

A target equal to ``IGNORE_INDEX`` (-100: the prompt and padding positions of
fine-tuning data, :mod:`polyshard.data.examples`) counts for nothing:
zero loss, zero gradient. The step's loss is the rule of Megatron-LM
(``calculate_per_token_loss``) and torchtitan (``global_valid_tokens``):

    loss = (sum of token losses over every microbatch of every data rank) / N,
    N = counted tokens of the global batch,

so every counted token weighs the same, whichever microbatch or data rank
holds it, and one process and any layout compute the same number. (The mean
of per-microbatch means would weigh a token of a microbatch holding few
response tokens more than one of a full microbatch, and differently per layout.)

The pipeline executor divides each microbatch's loss by m microbatches and
data parallelism averages gradients over R replicas (dp x ep x cp: every rank
that holds a part of the loss), so microbatch k's loss is its token-loss sum
divided by N / (R x m). Worked example, dp=2 and m=2,
microbatches holding 3 and 5 (rank 0), 4 and 0 (rank 1) counted tokens: N = 12,
each sum s_k is divided by 12 / 4 = 3; the averaged gradient is that of
(s_1/3 + s_2/3)/2 and (s_3/3 + s_4/3)/2 averaged, i.e. of (s_1+s_2+s_3+s_4) / 12.

Text counts every token: N / (R x m) is each microbatch's own token count and
the loss is the plain per-microbatch mean, bit for bit as before. A global
batch without a counted token (possible only with packed prompts longer than
whole rows) divides by 1: loss 0 and zero gradients.

The count reaches the loss as an argument: :func:`tokens_per_microbatch` works it out once per step
and the engine calls the loss with it (``loss(logits, targets, tokens_per_microbatch=...)``).
Evaluation calls the loss without it: it is then the batch's own mean.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.collectives import ops

# The data marks the positions; the loss skips them. Re-exported: tasks and the loop import it from here.
from polyshard.data.examples import IGNORE_INDEX as IGNORE_INDEX
from polyshard.tp import vocab_parallel_cross_entropy


class TokenMeanLoss:
    """``token_sum(logits, targets)`` (the summed loss of the counted tokens) divided by
    ``tokens_per_microbatch``, the counted tokens per microbatch of the step's global batch
    (:func:`tokens_per_microbatch`), or when not given by the batch's own count."""

    def __init__(self, token_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.token_sum = token_sum

    def __call__(
        self, logits: torch.Tensor, targets: torch.Tensor, tokens_per_microbatch: float | None = None
    ) -> torch.Tensor:
        count = tokens_per_microbatch
        if count is None:
            count = float((targets != IGNORE_INDEX).sum())
        return self.token_sum(logits, targets) / count


def tokens_per_microbatch(targets: torch.Tensor, replica_group: dist.ProcessGroup, num_microbatches: int) -> float:
    """The counted tokens of the global batch over (replicas x microbatches), what a
    :class:`TokenMeanLoss` divides each microbatch's sum by. ``targets`` is this rank's part; one
    all-reduce of one number over ``replica_group`` (dp x ep x cp) adds the parts up."""
    count = (targets != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
    ops.all_reduce(count, replica_group)
    replicas = dist.get_world_size(replica_group)
    return max(float(count), 1.0) / (replicas * num_microbatches)


def token_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(B, S) float32: each label's log-probability under softmax(logits / temperature), 0 where the label
    is IGNORE_INDEX; (B, S, V) logits, (B, S) labels. Under tp ``logits`` holds this rank's vocabulary
    columns and the log-softmax is the vocabulary-parallel one (no rank gathers the logits): every tp rank
    gets the same numbers. DPO sums them per row; GRPO keeps them per token."""
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    if tp_group is not None:
        losses = vocab_parallel_cross_entropy(
            scaled, labels, tp_group, vocab_size=vocab_size, ignore_index=IGNORE_INDEX, reduction="none"
        )
    else:
        losses = F.cross_entropy(
            scaled.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(labels.shape)
    return -losses
