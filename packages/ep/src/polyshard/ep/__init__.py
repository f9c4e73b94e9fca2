"""polyshard.ep: mixture-of-experts with expert parallelism over all-to-all dispatch."""

from polyshard.ep.config import MoEConfig
from polyshard.ep.dispatch import DispatchMeta, combine, dispatch
from polyshard.ep.errors import ExpertParallelError, MoEConfigError, check_ep_size
from polyshard.ep.experts import GroupedExperts
from polyshard.ep.layer import MoELayer, MoEMetrics, moe_metrics
from polyshard.ep.parallel import (
    apply_expert_parallel,
    average_replicated_gradients,
    expert_parameters,
    is_expert_parameter,
    planned_expert_placement,
    replicated_parameters,
    scale_expert_gradients,
    share_routing_statistics,
    sync_gradients,
)
from polyshard.ep.router import (
    Router,
    Routing,
    capacity_keep_mask,
    expert_capacity,
    limit_to_groups,
    load_balancing_loss,
    sequence_balance_loss,
    z_loss,
)
from polyshard.ep.token_group import router_losses, sequence_loss, sum_over_tokens

__all__ = [
    "DispatchMeta",
    "ExpertParallelError",
    "GroupedExperts",
    "MoEConfig",
    "MoEConfigError",
    "MoELayer",
    "MoEMetrics",
    "Router",
    "Routing",
    "apply_expert_parallel",
    "average_replicated_gradients",
    "capacity_keep_mask",
    "check_ep_size",
    "combine",
    "dispatch",
    "expert_capacity",
    "expert_parameters",
    "is_expert_parameter",
    "limit_to_groups",
    "load_balancing_loss",
    "moe_metrics",
    "planned_expert_placement",
    "replicated_parameters",
    "router_losses",
    "scale_expert_gradients",
    "sequence_balance_loss",
    "sequence_loss",
    "share_routing_statistics",
    "sum_over_tokens",
    "sync_gradients",
    "z_loss",
]
