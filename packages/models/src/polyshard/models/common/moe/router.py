"""Router: linear -> scores -> (biased, group-limited) top-k, the balancing losses and the capacity rule.

Three scoring rules, as the model families define them:

* ``softmax`` (Mixtral, Qwen-MoE, Switch): probabilities over experts; the chosen experts' weights
  are their probabilities, renormalised to sum 1 (Mixtral) or kept raw (Qwen-MoE as configured).
* ``sigmoid`` (DeepSeek-V3, 2412.19437 eqs. 12-16): an independent affinity per expert; a per-expert
  ``bias`` buffer is added for *selection only* (the auxiliary-loss-free balancing of Wang et al.
  2408.15664, updated by :meth:`Router.update_bias` from the measured load), and the chosen
  experts' weights are their unbiased affinities, normalised, times ``scale``.
* ``topk-softmax`` (gpt-oss): the k largest logits are chosen and their weights are a softmax over
  those k logits alone (so they sum to 1 and ``renormalize`` changes nothing); the balancing losses
  read the softmax over every expert, as for ``softmax``.

``router_bias`` adds a learned bias to the logits (gpt-oss's router is a Linear with a bias), the
parameter ``logit_bias`` (E,); it is not DeepSeek's selection-only ``bias`` buffer.

Group-limited routing (DeepSeek-V3's ``n_group`` / ``topk_group``): the experts are split into
``groups`` equal groups, each group is scored by the sum of its two highest (biased) scores, and
each token chooses its top k only among the ``group_topk`` best groups.

Shapes: T tokens, H hidden, E experts, k = top_k, G groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORES = ("softmax", "sigmoid", "topk-softmax")


@dataclass(frozen=True, eq=False)
class Routing:
    """The router's decision for T tokens."""

    logits: torch.Tensor  # (T, E), the router's raw scores
    probs: torch.Tensor  # (T, E) float32, each token's distribution over experts (softmax, or normalised sigmoid)
    weights: torch.Tensor  # (T, k) weight of each chosen expert in the token's output
    experts: torch.Tensor  # (T, k) int64 ids of the chosen experts, best first


class Router(nn.Module):
    """Scores every token against every expert and keeps the top k.

    The scores run in float32 whatever the input dtype: small differences in
    logits decide which expert a token visits, so they are kept precise.
    ``renormalize``: the chosen experts' weights are rescaled to sum 1. ``score``:
    'softmax' or 'sigmoid' (which adds the selection ``bias`` buffer, float32, zeros at start).
    ``groups`` / ``group_topk``: group-limited selection (1 / 1: off). ``scale``: the weights'
    routed scaling factor (DeepSeek-V3's ``routed_scaling_factor``; 1 leaves them as they are).
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        renormalize: bool = True,
        *,
        score: str = "softmax",
        groups: int = 1,
        group_topk: int = 1,
        scale: float = 1.0,
        router_bias: bool = False,
    ):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.score, self.groups, self.group_topk, self.scale = score, groups, group_topk, scale
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # The init nn.Linear uses, so a router starts close to uniform.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.logit_bias = nn.Parameter(torch.zeros(num_experts)) if router_bias else None  # (E,)
        self.bias: torch.Tensor | None
        # Replicated state, not a parameter: no gradient, no optimizer; saved with the weights.
        self.register_buffer("bias", torch.zeros(num_experts) if score == "sigmoid" else None)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = x @ self.weight.t()  # (T, H) @ (H, E) -> (T, E)
        if self.logit_bias is not None:
            logits = logits + self.logit_bias
        if self.score == "topk-softmax":  # choose by the logits, weigh by a softmax over the chosen k only
            top, experts = logits.float().topk(self.top_k, dim=-1)  # (T, k) each
            weights = torch.softmax(top, dim=-1) * self.scale if self.scale != 1.0 else torch.softmax(top, dim=-1)
            return Routing(logits, torch.softmax(logits.float(), dim=-1), weights, experts)
        if self.score == "softmax":
            scores = probs = torch.softmax(logits.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            probs = scores / scores.sum(dim=-1, keepdim=True)  # DeepSeek-V3 eq. 20's normalised affinities
        choice = scores if self.bias is None else scores + self.bias  # the bias only chooses
        if self.groups > 1:
            choice = limit_to_groups(choice, self.groups, self.group_topk)
        if choice is scores:
            weights, experts = scores.topk(self.top_k, dim=-1)  # (T, k) each
        else:
            experts = choice.topk(self.top_k, dim=-1).indices  # (T, k)
            weights = scores.gather(-1, experts)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return Routing(logits, probs, weights, experts)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3 section 2.1.2): ``bias_e += rate * sign(mean - load_e)``
        from ``load`` (E,), the assignments each expert got in the step over every token of the
        global batch. An overloaded expert becomes less likely to be chosen, an underloaded one more.
        Exact arithmetic on integer counts, so every rank given the same counts holds the same bias."""
        if self.bias is None:
            raise ValueError("update_bias needs a router with score='sigmoid' (only it has a selection bias)")
        self.bias.copy_(self.updated_bias(self.bias, load, rate))

    @staticmethod
    def updated_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
        """What :meth:`update_bias` makes of ``bias`` (float32), as a new tensor."""
        load = load.to(device=bias.device, dtype=torch.float64)
        return bias + (rate * torch.sign(load.mean() - load)).to(bias.dtype)


def limit_to_groups(choice: torch.Tensor, groups: int, group_topk: int) -> torch.Tensor:
    """(T, E) selection scores with every expert outside each token's ``group_topk`` best groups set to
    -inf. A group's score is the sum of its two highest scores (its one score if it holds one expert)."""
    tokens, num_experts = choice.shape
    grouped = choice.view(tokens, groups, num_experts // groups)  # (T, G, E/G)
    top = min(2, grouped.shape[-1])
    group_scores = grouped.topk(top, dim=-1).values.sum(dim=-1)  # (T, G)
    kept = group_scores.topk(group_topk, dim=-1).indices  # (T, group_topk)
    mask = torch.zeros(tokens, groups, dtype=torch.bool, device=choice.device).scatter_(1, kept, True)
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(tokens, num_experts)


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


def sequence_balance_loss(routing: Routing, num_experts: int, sequence_length: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (2412.19437 eqs. 17-20), averaged over
    the sequences: for each sequence of S tokens, sum_e f_e * P_e with f_e = E / (k S) * (the
    sequence's assignments to e) and P_e = the mean over its tokens of the normalised affinity
    ``probs``. The rows of ``routing`` are whole sequences, one after another. It is 1 when each
    sequence spreads evenly; the mean over sequences does not depend on how they are split over ranks."""
    top_k = routing.experts.shape[-1]
    experts = routing.experts.view(-1, sequence_length * top_k)  # (B, S*k)
    counts = F.one_hot(experts, num_experts).sum(dim=1).float()  # (B, E), no gradient
    fraction = counts * (num_experts / (top_k * sequence_length))
    mean_prob = routing.probs.view(-1, sequence_length, num_experts).mean(dim=1)  # (B, E)
    return (fraction * mean_prob).sum(dim=-1).mean()


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
