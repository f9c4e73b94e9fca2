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

The token group must split tokens only (each rank's tokens are distinct parts
of one batch): the ranks of ep or dp route different batches and keep their
own losses, as GShard does. The capacity rule would likewise need the whole
batch's token order and is refused with one (see :func:`polyshard.ep.share_routing_statistics`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from polyshard.collectives import copy_to, reduce_from
from polyshard.ep.router import Routing, load_balancing_loss, tokens_per_expert, z_loss


def sum_over_tokens(stats: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Per-token statistics summed over the token group.
    forward: all-reduce / backward: all-reduce (see the module docstring); the identity without a group."""
    if group is None or dist.get_world_size(group) == 1:
        return stats
    return copy_to(reduce_from(stats, group), group)


def router_losses(
    routing: Routing, num_experts: int, group: dist.ProcessGroup | None, with_z: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) of the batch whose tokens ``group`` splits (this rank's alone
    without a group, computed as :mod:`polyshard.ep.router` does). The z-loss is 0 unless ``with_z``."""
    if group is None:
        router_z = z_loss(routing) if with_z else torch.zeros((), device=routing.probs.device)
        return load_balancing_loss(routing, num_experts), router_z
    probs = routing.probs  # (T, E) float32
    counts = tokens_per_expert(routing.experts, num_experts).to(probs.dtype)  # (E,)
    lse2 = torch.logsumexp(routing.logits.float(), dim=-1).square().sum() if with_z else probs.new_zeros(())
    tokens = probs.new_full((1,), probs.shape[0])
    total = sum_over_tokens(torch.cat([counts, probs.sum(dim=0), lse2.reshape(1), tokens]), group)  # (2E + 2,)
    num_tokens = total[-1].detach()
    fraction = total[:num_experts].detach() / (num_tokens * routing.experts.shape[1])  # (E,) f_e
    mean_prob = total[num_experts : 2 * num_experts] / num_tokens  # (E,) P_e
    return num_experts * (fraction * mean_prob).sum(), total[-2] / num_tokens
