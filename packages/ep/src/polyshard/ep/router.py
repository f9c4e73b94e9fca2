"""Router: linear -> softmax -> top-k, the load-balancing and z losses, and the capacity rule.

Shapes: T tokens, H hidden, E experts, k = top_k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, eq=False)
class Routing:
    """The router's decision for T tokens."""

    logits: torch.Tensor  # (T, E), the router's raw scores
    probs: torch.Tensor  # (T, E) float32 softmax over experts
    weights: torch.Tensor  # (T, k) probability of each chosen expert (renormalised if asked)
    experts: torch.Tensor  # (T, k) int64 ids of the chosen experts, most probable first


class Router(nn.Module):
    """Scores every token against every expert and keeps the top k.

    The softmax runs in float32 whatever the input dtype: small differences in
    logits decide which expert a token visits, so they are kept precise.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool = True):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # The init nn.Linear uses, so a router starts close to uniform.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> Routing:
        logits = x @ self.weight.t()  # (T, H) @ (H, E) -> (T, E)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (T, k) each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, weights, experts)


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how many (token, expert) assignments each expert got."""
    return torch.bincount(experts.reshape(-1), minlength=num_experts)


def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_e f_e * P_e (Fedus et al. 2101.03961, eq. 4).

    f_e is the fraction of the T*k assignments that chose expert e (no gradient:
    it comes from an argmax), P_e the mean router probability of e (carries the
    gradient). It is 1 for perfectly uniform routing and E for total collapse.
    """
    num_assignments = routing.experts.numel()
    fraction = tokens_per_expert(routing.experts, num_experts).float() / num_assignments  # (E,)
    mean_prob = routing.probs.mean(dim=0)  # (E,)
    return num_experts * (fraction * mean_prob).sum()


def z_loss(routing: Routing) -> torch.Tensor:
    """Router z-loss mean_t logsumexp(logits_t)^2 (Zoph et al., ST-MoE 2202.08906, eq. 5)."""
    return torch.logsumexp(routing.logits.float(), dim=-1).square().mean()


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Most assignments one expert accepts from one rank: ceil(factor * T * k / E)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def capacity_keep_mask(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """(T, k) bool: which assignments fit within ``capacity`` per expert.

    Deterministic priority (GShard's): every token's first choice is served
    before any second choice, and within one choice rank earlier tokens win.
    Overflowing assignments are dropped; the token keeps its other experts and
    the layer outputs zero for a token that lost them all (the residual carries it).
    """
    top_k = experts.shape[1]
    queue = experts.t().reshape(-1)  # (k*T,) choice-major: all first choices, then all second...
    one_hot = F.one_hot(queue, num_experts)  # (k*T, E)
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # place in its expert's queue
    return (position < capacity).view(top_k, -1).t()
