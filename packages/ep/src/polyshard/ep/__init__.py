"""polyshard.ep: expert parallelism. Shards the experts of any layer that follows :class:`ExpertLayer`
over an ep group, dispatches tokens to their experts' ranks and back over all-to-alls, and fixes up the
gradients. The mixture-of-experts layer itself (router, experts, losses) is a model's:
:class:`polyshard.models.common.moe.MoELayer`."""

from polyshard.ep.dispatch import DispatchMeta, combine, dispatch
from polyshard.ep.errors import ExpertParallelError, check_ep_size
from polyshard.ep.parallel import (
    ExpertLayer,
    apply_expert_parallel,
    average_replicated_gradients,
    expert_layers,
    expert_parameters,
    is_expert_parameter,
    planned_expert_placement,
    replicated_parameters,
    scale_expert_gradients,
    share_routing_statistics,
    sync_gradients,
)

__all__ = [
    "DispatchMeta",
    "ExpertLayer",
    "ExpertParallelError",
    "apply_expert_parallel",
    "average_replicated_gradients",
    "check_ep_size",
    "combine",
    "dispatch",
    "expert_layers",
    "expert_parameters",
    "is_expert_parameter",
    "planned_expert_placement",
    "replicated_parameters",
    "scale_expert_gradients",
    "share_routing_statistics",
    "sync_gradients",
]
