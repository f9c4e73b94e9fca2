"""Vocabulary-parallel embedding and cross-entropy (Megatron-LM, 1909.08053, section 3).

The vocabulary V is padded up to a multiple of tp (Vp) and split into
contiguous ranges: rank r owns token ids [r * Vp/tp, (r+1) * Vp/tp). Padding
ids (>= V) are never looked up, and the loss gives them no probability mass.

Shapes: B batch, S sequence, E embedding size, N = B*S tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.collectives import ops
from polyshard.tp.errors import TPError
from polyshard.tp.regions import leave_region
from polyshard.tp.shard import padded_size, record_shard, take_shard, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: local weight (Vp/tp, E).

    forward: look up the ids in this rank's range, zero the rows of the others,
    then sum over the group: all-reduce -> (B, S, E), or reduce-scatter ->
    (B, S/tp, E) when ``sequence_parallel`` (the activations enter the
    sequence-parallel part straight away).
    backward: identity (all-gather with SP); each rank's gradient reaches only
    the rows it owns.

    Built directly it draws the full table as ``nn.Embedding`` does (N(0, 1))
    and keeps its slice; padding rows are zero.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: dist.ProcessGroup | None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        axis: str = "tp",
        source: nn.Embedding | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        full = source or nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype)
        num_embeddings, embedding_dim = full.num_embeddings, full.embedding_dim
        tp = tp_size(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = padded_size(num_embeddings, tp)
        self.rows_per_rank = self.padded_num_embeddings // tp
        self.vocab_start = tp_rank(tp_group) * self.rows_per_rank
        self.padding_idx = full.padding_idx
        self.tp_group, self.axis = tp_group, axis
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.weight = nn.Parameter(take_shard(full.weight, 0, tp_group, self.padded_num_embeddings))
        record_shard(
            self.weight, "weight", (num_embeddings, embedding_dim), 0, axis, (self.padded_num_embeddings, embedding_dim)
        )

    def _local_padding_idx(self) -> int | None:
        if self.padding_idx is None:
            return None
        local = self.padding_idx - self.vocab_start
        return local if 0 <= local < self.rows_per_rank else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_ids = ids - self.vocab_start  # (B, S)
        outside = (local_ids < 0) | (local_ids >= self.rows_per_rank)
        local_ids = local_ids.masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight, self._local_padding_idx())  # (B, S, E)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(partial, self.tp_group, self.sequence_parallel, self.sequence_dim)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.padded_num_embeddings}, local {self.rows_per_rank}), "
            f"{self.embedding_dim}, sequence_parallel={self.sequence_parallel}"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from vocabulary-sharded logits; no rank ever holds (N, V).

    forward: all-reduce(max) of the row maxima, then one all-reduce(sum) of
    [sum of exp, target logit] per token: 3 x N floats in total, whatever V is.
    loss = log(sum exp(z - max)) - (z_target - max).
    backward: d loss / d z = softmax(z) - onehot(target), computed locally.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        vocab_start: int,
        vocab_size: int,
        ignore_index: int,
    ) -> torch.Tensor:
        local_vocab = logits.shape[-1]  # logits: (N, Vp/tp), target: (N,)
        ctx.input_dtype = logits.dtype
        columns = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device)
        # At least float32 for the softmax (bf16/fp16 logits are upcast; float64 stays float64).
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).masked_fill(
            columns >= vocab_size, float("-inf")
        )  # padding: no mass
        row_max = logits.max(dim=-1).values  # -inf on a rank holding only padding
        ops.all_reduce(row_max, tp_group, op=dist.ReduceOp.MAX)
        exp = (logits - row_max.unsqueeze(-1)).exp_()  # (N, Vp/tp); padding columns are 0
        valid = target != ignore_index
        local_target = target - vocab_start
        mine = valid & (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.masked_fill(~mine, 0)
        target_logit = logits.gather(1, local_target.unsqueeze(1)).squeeze(1) - row_max
        stats = torch.stack([exp.sum(dim=-1), target_logit.masked_fill(~mine, 0.0)])  # (2, N)
        ops.all_reduce(stats, tp_group)
        sum_exp, target_logit = stats
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # reuse the exp buffer
        ctx.save_for_backward(softmax, local_target, mine, valid)
        return loss  # type: ignore[no-any-return]  # unpacking stats (a Tensor) is untyped in torch

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        softmax, local_target, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= mine.to(grad.dtype)  # subtract the one-hot where the target is ours
        grad.mul_((grad_loss * valid).unsqueeze(-1))  # ignored tokens get no gradient
        return grad.to(ctx.input_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` over the full vocabulary, from this rank's logit shard.

    ``logits``: (..., Vp/tp), this rank's contiguous range of the padded
    vocabulary (the output of a column-parallel head without gather_output).
    ``target``: (...) global token ids, the same on every rank. ``vocab_size``:
    the real V; columns at or past it are padding and get probability 0
    (default: no padding). ``ignore_index`` and ``reduction`` ("mean", "sum",
    "none") behave as in ``F.cross_entropy``; "mean" averages over the tokens
    that are not ignored (NaN when all are, as torch does).
    """
    if reduction not in ("mean", "sum", "none"):
        raise TPError(f"reduction={reduction!r} is not supported; use 'mean', 'sum' or 'none'")
    if logits.shape[:-1] != target.shape:
        raise TPError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree; "
            "logits must be target's shape plus a trailing vocabulary dim"
        )
    local_vocab = logits.shape[-1]
    padded = local_vocab * tp_size(tp_group)
    vocab_size = padded if vocab_size is None else vocab_size
    tp = tp_size(tp_group)
    if not padded - tp < vocab_size <= padded:
        raise TPError(
            f"vocab_size={vocab_size} does not fit logit shards of {local_vocab} columns on tp={tp}; "
            f"the shards must hold the vocabulary padded to a multiple of tp, i.e. {padded - tp + 1}..{padded} ids"
        )
    out_of_range = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(out_of_range.any()):
        raise TPError(f"target holds ids outside [0, {vocab_size}) that are not ignore_index={ignore_index}")
    vocab_start = tp_rank(tp_group) * local_vocab
    # Function.apply is untyped in torch; it returns forward's per-token loss.
    loss: torch.Tensor = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        logits.reshape(-1, local_vocab), target.reshape(-1), tp_group, vocab_start, vocab_size, ignore_index
    )
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
