"""The mixture-of-experts layer every MoE family uses: the router, the grouped experts, the layer that
routes, dispatches (through :mod:`polyshard.ep`, over the ep ranks when it is expert-parallel) and
combines, the balancing losses (over a token group under cp and sequence parallelism), and the
``[model.moe]`` settings that configure it (:class:`MoEConfig`, one class for a config and a layer built by hand)."""

from polyshard.models.common.moe.config import ACTIVATIONS, MAX_EXPERTS, MoEConfig
from polyshard.models.common.moe.experts import GroupedExperts, grouped_mm
from polyshard.models.common.moe.layer import MoELayer, MoEMetrics, moe_metrics
from polyshard.models.common.moe.router import (
    SCORES,
    Router,
    Routing,
    capacity_keep_mask,
    expert_capacity,
    limit_to_groups,
    load_balancing_loss,
    sequence_balance_loss,
    tokens_per_expert,
    z_loss,
)
from polyshard.models.common.moe.token_group import capacity_keep, router_losses, sequence_loss, sum_over_tokens
from polyshard.models.errors import MoEConfigError

__all__ = [
    "ACTIVATIONS",
    "MAX_EXPERTS",
    "SCORES",
    "GroupedExperts",
    "MoEConfig",
    "MoEConfigError",
    "MoELayer",
    "MoEMetrics",
    "Router",
    "Routing",
    "capacity_keep",
    "capacity_keep_mask",
    "expert_capacity",
    "grouped_mm",
    "limit_to_groups",
    "load_balancing_loss",
    "moe_metrics",
    "router_losses",
    "sequence_balance_loss",
    "sequence_loss",
    "sum_over_tokens",
    "tokens_per_expert",
    "z_loss",
]
