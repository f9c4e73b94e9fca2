"""Token dispatch to the experts' owners and the combine that reverses it.

Shapes: T local tokens, k = top_k, A assignments this rank sends (T*k minus
dropped), N rows this rank's experts receive, H hidden, E experts, P = ep size,
E_local = E / P. Rank i owns experts [i*E_local, (i+1)*E_local).

Example, P=2, E=4, T=3, top-1, rank 0 routes tokens to experts [2, 0, 3]::

    send (expert-major)   token1->e0 | token0->e2, token2->e3     send_splits  = (1, 2)
    counts all-to-all     rank 0 learns rank 1's counts for e0, e1
    payload all-to-all    rank 1 receives [token0, token2] from rank 0 (then its own rows)
    regroup               received rows reordered so each local expert's rows are contiguous
    combine               the exact reverse, then y[t] = sum_k weight[t, k] * expert_output

``group=None`` means no expert parallelism (all experts local, no
communication); any group of size P > 1 exchanges tokens over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polyshard.collectives import all_to_all, ops


@dataclass(frozen=True, eq=False)
class DispatchMeta:
    """Everything ``combine`` needs to send expert outputs back and sum them per token."""

    num_tokens: int
    """T: tokens this rank routed."""
    token_index: torch.Tensor
    """(A,) source token of each sent row, in send (expert-major) order."""
    assignment_index: torch.Tensor
    """(A,) index into the flattened (T*k) router weights of each sent row."""
    send_splits: tuple[int, ...]
    """Rows this rank sent to each ep rank."""
    recv_splits: tuple[int, ...]
    """Rows this rank received from each ep rank."""
    regroup_order: torch.Tensor | None
    """(N,) received-row index for each row of the expert-major input; None where the received rows
    are already expert-major (one ep rank, or one expert per rank), which saves a gather of every row
    forward and its scatter backward."""
    restore_order: torch.Tensor | None
    """(N,) inverse of ``regroup_order``: expert-major row for each received row (None with it)."""
    tokens_per_local_expert: tuple[int, ...]
    """Rows each local expert processes (from all ranks)."""
    group: dist.ProcessGroup | None
    """The ep group the rows travelled over (None: no expert parallelism)."""


def ep_size_of(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def dispatch(
    x: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, DispatchMeta]:
    """Send each token to the ranks owning its chosen experts.

    x: (T, H), experts: (T, k) expert ids, keep: (T, k) bool (None keeps all).
    Returns the (N, H) rows for this rank's experts, grouped by local expert,
    and the metadata ``combine`` consumes.
    forward: counts all-to-all + payload all-to-all / backward: payload all-to-all in reverse.
    """
    num_tokens, top_k = experts.shape
    ep_size = ep_size_of(group)
    local_experts = num_experts // ep_size
    flat_experts = experts.reshape(-1)  # (T*k,) token-major: token t's choices at t*k .. t*k+k-1
    assignment_index = _expert_major(flat_experts, keep)  # (A,)
    token_index = assignment_index // top_k
    send_counts = torch.bincount(flat_experts[assignment_index], minlength=num_experts)  # (E,)

    recv_counts = _exchange_counts(send_counts, local_experts, group)  # (P, E_local)
    send_splits = tuple(send_counts.view(ep_size, local_experts).sum(dim=1).tolist())
    recv_splits = tuple(recv_counts.sum(dim=1).tolist())
    received = _exchange_rows(x[token_index], recv_splits, send_splits, group)  # (A, H) -> (N, H)

    regrouped = ep_size > 1 and local_experts > 1  # otherwise the received rows are expert-major already
    regroup_order = _regroup_order(recv_counts.to(x.device)) if regrouped else None  # (N,)
    meta = DispatchMeta(
        num_tokens=num_tokens,
        token_index=token_index,
        assignment_index=assignment_index,
        send_splits=send_splits,
        recv_splits=recv_splits,
        regroup_order=regroup_order,
        restore_order=torch.argsort(regroup_order) if regroup_order is not None else None,
        tokens_per_local_expert=tuple(recv_counts.sum(dim=0).tolist()),
        group=group,
    )
    return (received[regroup_order] if regroup_order is not None else received), meta


def combine(expert_output: torch.Tensor, weights: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
    """Return expert outputs to their tokens and sum them weighted by the router.

    expert_output: (N, H) grouped by local expert, weights: (T, k).
    Returns (T, H); a token whose every assignment was dropped gets zeros.
    forward: payload all-to-all (reverse of dispatch) / backward: payload all-to-all.
    """
    by_source = expert_output if meta.restore_order is None else expert_output[meta.restore_order]  # (N, H)
    # ... back in (source rank, local expert) order
    returned = _exchange_rows(by_source, meta.send_splits, meta.recv_splits, meta.group)  # (N, H) -> (A, H)
    row_weights = weights.reshape(-1)[meta.assignment_index].to(returned.dtype).unsqueeze(-1)  # (A, 1)
    out = returned.new_zeros(meta.num_tokens, returned.shape[-1])
    return out.index_add(0, meta.token_index, returned * row_weights)  # sum over each token's experts


def _expert_major(flat_experts: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """(A,) indices of the kept assignments sorted by expert; stable, so token order holds within an expert."""
    assignment_index = torch.arange(flat_experts.numel(), device=flat_experts.device)
    if keep is not None:
        assignment_index = assignment_index[keep.reshape(-1)]
    return assignment_index[torch.argsort(flat_experts[assignment_index], stable=True)]


def _regroup_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """(N,) order turning received rows (source rank, local expert) into (local expert, source rank).

    recv_counts: (P, E_local), rows from rank j for local expert l at [j, l].
    """
    ep_size, local_experts = recv_counts.shape
    row_expert = torch.arange(local_experts, device=recv_counts.device).repeat(ep_size)  # (P*E_local,)
    row_expert = row_expert.repeat_interleave(recv_counts.reshape(-1))  # (N,) local expert of each received row
    return torch.argsort(row_expert, stable=True)


def _exchange_counts(send_counts: torch.Tensor, local_experts: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(E,) my counts per expert -> (P, E_local): every rank's counts for my experts (the small all-to-all)."""
    ep_size = ep_size_of(group)
    if ep_size == 1:
        return send_counts.view(1, -1)
    splits = [local_experts] * ep_size
    return ops.all_to_all(send_counts, splits, splits, group).view(ep_size, local_experts)


def _exchange_rows(
    rows: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Autograd all-to-all of rows; the identity without expert parallelism."""
    if ep_size_of(group) == 1:
        return rows
    return all_to_all(rows, output_splits, input_splits, group)
