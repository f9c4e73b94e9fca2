"""Routing losses over a token group: ranks that hold parts of the same batch's tokens.

Context parallelism cuts every sequence over its cp ranks, so each one routes
only its chunks' tokens. The Switch/GShard load-balancing loss
E * sum_e f_e * P_e is not a sum over tokens (a product of two token means),
so the loss of a chunk is not a part of the batch's loss. With a token group
each rank instead sums its per-expert statistics over the group and computes
the loss of the whole batch, the number the same rank without cp computes:

    stats  = [assignments per expert (E), router probabilities summed per expert (E),
              sum of logsumexp^2 over tokens (1), tokens (1)]           on each rank
    total  = sum of stats over the token group                          one all-reduce of 2E + 2 floats
    f_e    = total.assignments_e / (total.tokens * k)     (no gradient: it comes from a top-k)
    P_e    = total.probabilities_e / total.tokens
    z      = total.lse2 / total.tokens

Gradient. The sum is forward: all-reduce / backward: all-reduce
(``copy_to(reduce_from(x))``). Every rank of a group of G computes the same
loss, and a trainer averages gradients over its replicas, the token group
among them: the loss it differentiates holds G copies of the batch's aux loss
(divided by G with the rest). A copy's gradient w.r.t. this rank's
probabilities is one share; all G copies give G shares, which is what the
all-reduce in backward sums (each copy's upstream gradient is the same on
every rank). Averaged over the G ranks, their shares add up to one gradient
of the batch's aux loss, as without the group. Worked example, cp=2, one
expert's P_e = (p0 + p1) / T from the two ranks' sums p0, p1: the loss
replicas average to (aux + aux) / 2, whose gradient w.r.t. p0 is
2 * (d aux / d P_e) / T / 2 = (d aux / d P_e) / T, what one process gets.

Sequence parallelism (tp ranks each holding a sequence shard at the MLP)
puts the tp ranks in the token group too, but a trainer does not average
over tp: every tp rank computes the same loss, counted once, and sums the
gradients of parameters that saw a sequence shard. There the G_tp shares the
backward all-reduce gives a rank would count the loss G_tp times over, so
``loss_sharers`` = G_tp divides them out: each rank keeps G_cp shares
(cp x tp: the cp average then makes one), and the tp sum adds the ranks'
tokens into one gradient of the batch's aux loss. Worked example, tp=2 with
SP, no cp: the shared probability sum P_e = (p0 + p1) / T; the backward
all-reduce gives rank 0 2 * (d aux / d P_e) / T, halved to one share; rank
1 likewise; summed over tp the router's gradient holds each token once.

The token group must split tokens only (each rank's tokens are distinct parts
of one batch): the ranks of ep or dp route different batches and keep their
own losses, as GShard does.

Capacity. The rule (:func:`polyshard.models.common.moe.router.capacity_keep_mask`) serves a
batch's first choices before its second ones, earlier tokens first, up to
ceil(factor * T * k / E) per expert, T the batch's tokens. A rank holding
some of the sequence positions gathers every rank's expert choices
(T * k int64, no gradient) with their positions, applies the rule to the
whole batch in sequence order and keeps its own rows: the assignments the
same rank without cp keeps. Inputs are (..., S_local, H), the positions those
of the S_local dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.collectives import copy_to, ops, reduce_from
from polyshard.ep import ExpertParallelError
from polyshard.models.common.moe.router import (
    Routing,
    capacity_keep_mask,
    expert_capacity,
    load_balancing_loss,
    sequence_balance_loss,
    tokens_per_expert,
    z_loss,
)


def sum_over_tokens(stats: torch.Tensor, group: dist.ProcessGroup | None, loss_sharers: int = 1) -> torch.Tensor:
    """Per-token statistics summed over the token group.
    forward: all-reduce / backward: all-reduce, divided by ``loss_sharers`` (see the module docstring);
    the identity without a group."""
    if group is None or dist.get_world_size(group) == 1:
        return stats
    if loss_sharers > 1 and stats.requires_grad:
        stats = stats * 1.0  # a fresh node to hook: the hook scales only this sum's gradient
        stats.register_hook(lambda grad: grad / loss_sharers)
    return copy_to(reduce_from(stats, group), group)


def router_losses(
    routing: Routing, num_experts: int, group: dist.ProcessGroup | None, with_z: bool, loss_sharers: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) of the batch whose tokens ``group`` splits (this rank's alone
    without a group, computed as :mod:`polyshard.models.common.moe.router` does). The z-loss is 0 unless ``with_z``."""
    if group is None:
        router_z = z_loss(routing) if with_z else torch.zeros((), device=routing.probs.device)
        return load_balancing_loss(routing, num_experts), router_z
    probs = routing.probs  # (T, E) float32
    counts = tokens_per_expert(routing.experts, num_experts).to(probs.dtype)  # (E,)
    lse2 = torch.logsumexp(routing.logits.float(), dim=-1).square().sum() if with_z else probs.new_zeros(())
    tokens = probs.new_full((1,), probs.shape[0])
    stats = torch.cat([counts, probs.sum(dim=0), lse2.reshape(1), tokens])
    total = sum_over_tokens(stats, group, loss_sharers)  # (2E + 2,)
    num_tokens = total[-1].detach()
    fraction = total[:num_experts].detach() / (num_tokens * routing.experts.shape[1])  # (E,) f_e
    mean_prob = total[num_experts : 2 * num_experts] / num_tokens  # (E,) P_e
    return num_experts * (fraction * mean_prob).sum(), total[-2] / num_tokens


def sequence_loss(
    routing: Routing, num_experts: int, sequence_length: int, group: dist.ProcessGroup | None, loss_sharers: int = 1
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (:func:`polyshard.models.common.moe.router.sequence_balance_loss`) of
    whole sequences whose positions ``group`` splits (``sequence_length``: this rank's part of each):
    per sequence, its assignments and probabilities summed per expert over the group, as
    :func:`router_losses` sums the batch's; this rank's sequences alone without a group."""
    if group is None or dist.get_world_size(group) == 1:
        return sequence_balance_loss(routing, num_experts, sequence_length)
    top_k = routing.experts.shape[-1]
    experts = routing.experts.view(-1, sequence_length * top_k)  # (B, S_local * k)
    probs = routing.probs.view(-1, sequence_length, num_experts)  # (B, S_local, E)
    counts = F.one_hot(experts, num_experts).sum(dim=1).to(probs.dtype)  # (B, E), no gradient
    tokens = probs.new_full((probs.shape[0], 1), sequence_length)
    stats = torch.cat([counts, probs.sum(dim=1), tokens], dim=1)
    total = sum_over_tokens(stats, group, loss_sharers)  # (B, 2E + 1)
    length = total[:, -1:].detach()  # (B, 1): whole sequences
    fraction = total[:, :num_experts].detach() * (num_experts / top_k) / length
    mean_prob = total[:, num_experts : 2 * num_experts] / length
    return (fraction * mean_prob).sum(dim=-1).mean()


def capacity_keep(
    experts: torch.Tensor,
    num_experts: int,
    capacity_factor: float,
    group: dist.ProcessGroup | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T, k) bool: which of this rank's assignments the capacity rule keeps, applied to the batch whose
    sequence positions ``group`` splits (``positions``: (S_local,) this rank's, along the second-to-last
    input dim, which ``experts`` (T, k) flattens last), or to this rank's tokens without a group."""
    top_k = experts.shape[1]
    if group is None or dist.get_world_size(group) == 1:
        capacity = expert_capacity(experts.shape[0], top_k, num_experts, capacity_factor)
        return capacity_keep_mask(experts, num_experts, capacity)
    if positions is None:
        raise ExpertParallelError("the capacity rule over a token group needs the positions of this rank's tokens")
    local = positions.numel()
    rows = experts.shape[0] // local  # every leading dim of (..., S_local)
    gathered = ops.all_gather(experts.view(rows, local, top_k), 1, group)  # (rows, S, k) in rank order
    order = ops.all_gather(positions.to(experts.device), 0, group)  # (S,) each gathered column's position
    whole = torch.empty_like(gathered)
    whole[:, order] = gathered  # (rows, S, k) in sequence order
    capacity = expert_capacity(whole.shape[0] * whole.shape[1], top_k, num_experts, capacity_factor)
    keep = capacity_keep_mask(whole.view(-1, top_k), num_experts, capacity).view(whole.shape)
    return keep[:, positions.to(experts.device)].reshape(-1, top_k)  # (T, k) this rank's rows
