"""The output head and the cross-entropy in chunks of tokens: the (N, V) logits never exist at once.

For each chunk of tokens: logits = hidden_chunk @ W^T, its summed cross-entropy, and nothing kept
but the chunk's input (a view of ``hidden``) and W; backward recomputes the chunk's logits, one chunk
at a time (activation checkpointing per chunk, torchtitan's and torchtune's chunked loss idea; Liger's
fused linear cross-entropy is the same maths as one GPU kernel). Peak memory of the loss goes from
~3 x N x V floats (logits, softmax, their gradient) to ~3 x (N / chunks) x V, for one more head matmul.

Under tensor parallelism W is this rank's vocabulary rows (a column-parallel head's ``weight``,
padded) and each chunk's loss is :func:`vocab_parallel_cross_entropy`: its all-reduces run again, in
the same order on every rank, when backward recomputes the chunk.

Shapes: N tokens, H hidden, V vocabulary (V/tp local).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from polyshard.tp.errors import TPError
from polyshard.tp.linear import ColumnParallelLinear
from polyshard.tp.regions import enter_region
from polyshard.tp.vocab import vocab_parallel_cross_entropy


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    *,
    chunks: int,
    bias: torch.Tensor | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, reduction="sum")`` over ``chunks`` chunks
    of tokens, each recomputed in backward; the logits are upcast to float32 per chunk.

    ``hidden``: (N, H), already inside the tp region (see :func:`head_input`); ``weight``: (V or Vp/tp, H);
    ``target``: (N,) global ids. With ``tp_group`` the loss is vocabulary-parallel (``vocab_size``: the
    real V, columns past it are padding); without, plain cross-entropy.
    """
    if chunks < 1:
        raise TPError(f"chunks={chunks} must be >= 1")
    if hidden.dim() != 2 or target.shape != hidden.shape[:1]:
        raise TPError(
            f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)}: give (N, H) hidden states and (N,) targets"
        )

    def chunk_loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, w, b).float()  # (n, H) @ (H, V/tp) -> (n, V/tp): the only logits alive
        if tp_group is None:
            return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum")
        return vocab_parallel_cross_entropy(
            logits, t, tp_group, vocab_size=vocab_size, ignore_index=ignore_index, reduction="sum"
        )

    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(hidden.tensor_split(chunks), target.tensor_split(chunks), strict=True):
        # checkpoint returns chunk_loss's value; torch types it Any.
        loss: torch.Tensor = checkpoint(chunk_loss, h, weight, bias, t, use_reentrant=False)
        total = total + loss
    return total


def head_input(projection: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``projection``'s matmul sees it: a column-parallel head enters the tp region first
    (identity forward and all-reduce backward; the all-gather along the sequence under sequence
    parallelism); a plain ``nn.Linear`` takes it as it is."""
    if isinstance(projection, ColumnParallelLinear) and not projection.input_entered:
        return enter_region(x, projection.tp_group, projection.sequence_parallel, projection.sequence_dim)
    return x
