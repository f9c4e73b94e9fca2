"""Load-balanced sequence sharding for causal attention.

Shapes: S is the global sequence length, ``cp`` the size of the context-parallel group, C = S / (2 cp)
the chunk length; every rank holds 2C tokens.

Under a causal mask the last query attends to every key and the first to one, so cutting the
sequence into cp contiguous pieces would give the last rank about 2cp - 1 times the work of the
first. Instead the sequence is cut into 2 cp chunks and rank r holds chunks r and 2cp - 1 - r, one
early and one late (the layout of Megatron-LM's context parallelism and of Llama 3, Dubey et al.
2407.21783 section 3.3.2); every rank then sees the same number of (query, key) pairs.

cp=2, S=8 (C=2)::

    position  0 1 | 2 3 | 4 5 | 6 7
    chunk       0     1     2     3
    rank        0     1     1     0

    rank 0 holds positions [0, 1, 6, 7] (chunks 0 and 3); rank 1 holds [2, 3, 4, 5] (chunks 1 and 2)

cp=4, S=16: rank 0 holds [0 1 14 15], rank 1 [2 3 12 13], rank 2 [4 5 10 11], rank 3 [6 7 8 9].

Within a rank the two chunks keep their order, so its local tokens are still in increasing position.
Rotary embeddings must use :func:`position_ids`, not ``arange(2C)``, so each token keeps its
global position.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from polyshard.collectives import gather_from
from polyshard.cp.errors import ContextParallelError, check_sequence_length


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two global chunk indices (of 2 cp) that ``rank`` holds, in local order."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, rank: int, cp: int) -> torch.Tensor:
    """Global positions of ``rank``'s 2C tokens (no process group needed), int64 of shape (2C,)."""
    check_sequence_length(seq_len, cp)
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in rank_chunks(rank, cp)])


def position_ids(
    seq_len: int, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions of this rank's tokens of a ``seq_len`` sequence sharded by :func:`shard_sequence`;
    pass them to rotary embeddings so the positions follow the tokens. int64, shape (2C,)."""
    positions = local_positions(seq_len, dist.get_rank(group), dist.get_world_size(group))
    return positions if device is None else positions.to(device)


def shard_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's chunks r and 2cp-1-r of ``x`` along ``dim``, concatenated (no communication).
    Differentiable: the gradient flows back to the two chunks' positions of ``x``."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    check_sequence_length(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = rank_chunks(rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(x_local: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather every rank's ``x_local`` along ``dim`` and put the 2 cp chunks back in sequence order.

    Differentiable as Megatron's gather (``polyshard.collectives.gather_from``): backward keeps this
    rank's piece of the gradient, which is right when every rank uses the gathered tensor alike.
    """
    cp = dist.get_world_size(group)
    if x_local.shape[dim] % 2:
        raise ContextParallelError(
            f"unshard_sequence got {x_local.shape[dim]} tokens along dim {dim}, an odd number: a rank holds "
            "two equal chunks; pass the tensor that shard_sequence (or the attention) produced"
        )
    return to_sequence_order(gather_from(x_local, dim, group), dim, cp)


def to_sequence_order(gathered: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Reorder the rank-order concatenation of every rank's two chunks (what an all-gather along
    ``dim`` returns: chunks 0, 2cp-1, 1, 2cp-2, ...) into sequence order 0, 1, ..., 2cp-1."""
    slots = gathered.chunk(2 * cp, dim=dim)  # slot 2r holds chunk r, slot 2r+1 holds chunk 2cp-1-r
    slot_of = [2 * c if c < cp else 2 * (2 * cp - 1 - c) + 1 for c in range(2 * cp)]
    return torch.cat([slots[s] for s in slot_of], dim=dim)


def to_rank_order(ordered: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """The inverse of :func:`to_sequence_order`: 2 cp chunks in sequence order -> each rank's two
    chunks r and 2cp-1-r, rank after rank (what each rank of an all-to-all must get back)."""
    chunks = ordered.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for r in range(cp) for c in rank_chunks(r, cp)], dim=dim)
