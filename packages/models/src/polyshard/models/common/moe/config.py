"""Configuration of one mixture-of-experts layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from polyshard.mesh import divisors
from polyshard.models.common.moe.router import SCORES
from polyshard.models.errors import MoEConfigError

ACTIVATIONS = ("swiglu", "gelu", "clamped-swiglu")


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    """What an :class:`polyshard.models.common.moe.MoELayer` computes; validated on construction."""

    hidden: int
    """Model width H: size of each token's vector in and out."""
    ffn_hidden: int
    """Width F of each expert's MLP."""
    num_experts: int
    """Total number of experts E (over all ranks)."""
    top_k: int = 2
    """How many experts each token goes to."""
    renormalize: bool = True
    """Rescale the chosen top-k probabilities to sum to 1 (Mixtral); False keeps the raw softmax values (Switch)."""
    score: str = "softmax"
    """Router scores: 'softmax' (Mixtral, Qwen-MoE), 'sigmoid' (DeepSeek-V3: with a per-expert selection
    bias for auxiliary-loss-free balancing, see :meth:`Router.update_bias`) or 'topk-softmax'
    (gpt-oss: the top k logits chosen, their weights a softmax over those k alone)."""
    groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): experts split into this many equal groups; 1 is off."""
    group_topk: int = 1
    """With groups > 1: each token chooses its experts within its best group_topk groups (topk_group)."""
    scale: float = 1.0
    """Factor on the chosen experts' weights (DeepSeek-V3's routed_scaling_factor)."""
    activation: str = "swiglu"
    """Expert MLP: 'swiglu' (silu(x W1) * (x W3)) W2, 'gelu' gelu(x W1) W2, or 'clamped-swiglu' (gpt-oss):
    gate and up clamped at swiglu_limit, ((up + 1) * gate * sigmoid(swiglu_alpha * gate)) W2, gate and up
    interleaved in one W1 (see :class:`polyshard.models.common.moe.GroupedExperts`)."""
    swiglu_alpha: float = 1.702
    """With 'clamped-swiglu': the sigmoid's gain (gpt-oss: 1.702, GELU's sigmoid approximation)."""
    swiglu_limit: float = 7.0
    """With 'clamped-swiglu': gate clamped above at this, up to [-limit, limit] (gpt-oss: 7)."""
    router_bias: bool = False
    """A learned bias on the router's logits (gpt-oss's router is a Linear with a bias)."""
    expert_bias: bool = False
    """Biases on each expert's first and last matrices (gpt-oss); they go with their experts under ep."""
    capacity_factor: float | None = None
    """None: dropless. Otherwise each expert takes at most ceil(factor * T * top_k / E) of a rank's T tokens."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard load-balancing loss in the returned auxiliary loss."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE, 2202.08906); 0 turns it off."""
    seq_aux_loss_coef: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss (per sequence of the layer's (B, S, H) input)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn_hidden", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise MoEConfigError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.top_k > self.num_experts:
            raise MoEConfigError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}: a token cannot visit more "
                f"experts than exist; choose top_k in 1..{self.num_experts}"
            )
        if self.activation not in ACTIVATIONS:
            raise MoEConfigError(f"activation={self.activation!r} is unknown; choose one of {ACTIVATIONS}")
        if not (math.isfinite(self.swiglu_alpha) and self.swiglu_alpha > 0):
            raise MoEConfigError(f"swiglu_alpha={self.swiglu_alpha} must be a finite number > 0 (gpt-oss: 1.702)")
        if not (math.isfinite(self.swiglu_limit) and self.swiglu_limit > 0):
            raise MoEConfigError(f"swiglu_limit={self.swiglu_limit} must be a finite number > 0 (gpt-oss: 7.0)")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise MoEConfigError(
                f"capacity_factor={self.capacity_factor} must be > 0 (e.g. 1.25), or None for dropless routing"
            )
        if min(self.aux_loss_coef, self.z_loss_coef, self.seq_aux_loss_coef) < 0:
            raise MoEConfigError(
                f"loss coefficients must be >= 0, got aux_loss_coef={self.aux_loss_coef}, "
                f"z_loss_coef={self.z_loss_coef}, seq_aux_loss_coef={self.seq_aux_loss_coef}; use 0 to turn a loss off"
            )
        self._check_routing()

    def _check_routing(self) -> None:
        if self.score not in SCORES:
            raise MoEConfigError(f"score={self.score!r} is unknown; choose one of {SCORES}")
        if not self.scale > 0:
            raise MoEConfigError(f"scale={self.scale} must be > 0 (1 leaves the routing weights as they are)")
        if self.groups < 1 or self.num_experts % self.groups:
            raise MoEConfigError(
                f"groups={self.groups} must divide num_experts={self.num_experts} into equal groups; "
                f"choose groups in {divisors(self.num_experts)} (1 turns group-limited routing off)"
            )
        if self.score == "topk-softmax" and self.groups > 1:
            raise MoEConfigError(
                f"groups={self.groups} limits routing to groups by their scores, which score='topk-softmax' does "
                "not compute over every expert; set groups=1 or score='softmax'/'sigmoid'"
            )
        if not 1 <= self.group_topk <= self.groups:
            raise MoEConfigError(f"group_topk={self.group_topk} must be between 1 and groups={self.groups}")
        reachable = self.group_topk * (self.num_experts // self.groups)
        if self.top_k > reachable:
            raise MoEConfigError(
                f"top_k={self.top_k} exceeds the {reachable} experts in group_topk={self.group_topk} groups of "
                f"{self.num_experts // self.groups}; raise group_topk or lower top_k"
            )
