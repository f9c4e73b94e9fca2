"""Learning path 7: expert parallelism - each ep rank holds E/ep experts; every token's hidden state
travels by all-to-all to the ranks of its top-k experts and back (dispatch, combine).

Capacity (GShard): an expert takes at most ceil(factor x T x k / E) assignments from one rank; the rest
are dropped. The example routes the same tokens on one process and over ep=2 and compares.

Run: python examples/07_experts.py   (2 CPU processes, gloo; about 15 s)
"""

import copy

import torch
import torch.distributed as dist

from polyshard.collectives import CommLedger
from polyshard.ep import apply_expert_parallel
from polyshard.mesh.pool import WorkerPool
from polyshard.models.common.moe import MoEConfig, MoELayer, expert_capacity

CONFIG = dict(ffn_hidden=32, num_experts=4, top_k=2)


def ep_forward(capacity_factor: float | None) -> dict[str, object]:
    torch.manual_seed(0)
    reference = MoELayer(MoEConfig(**CONFIG, capacity_factor=capacity_factor), hidden=16)
    x = torch.randn(2, 2, 16, 16)  # (ranks, B, S, H): every rank draws all, takes its own
    rank = dist.get_rank()
    layer = apply_expert_parallel(copy.deepcopy(reference), group=dist.group.WORLD)
    with CommLedger() as ledger:
        y, _ = layer(x[rank])
    y_ref, _ = reference(x[rank])  # one process with all four experts, this rank's tokens
    metrics = layer.last_metrics
    assert metrics is not None
    return {
        "experts on this rank": layer.experts.num_experts,
        "assignments per expert (rank 0's tokens)": metrics.tokens_per_expert,
        "capacity per expert": expert_capacity(32, 2, 4, capacity_factor) if capacity_factor else "none",
        "dropped assignments": metrics.dropped_assignments,
        "all-to-all calls": ledger.calls("all_to_all"),
        "max |y - one process|": (y - y_ref).abs().max().item(),
    }


def main() -> None:
    pool = WorkerPool(2)
    try:
        for factor in (None, 1.0):
            print(f"capacity_factor={factor}")
            for key, value in pool.run(ep_forward, factor)[0].items():
                print(f"  {key:<42} {value:.1e}" if isinstance(value, float) else f"  {key:<42} {value}")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
