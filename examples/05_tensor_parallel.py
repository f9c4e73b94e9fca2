"""Learning path 5: tensor parallelism - split each weight matrix over the tp ranks (Megatron-LM).

An MLP's first linear is split by output features (ColumnParallel: the f operator, identity forward and
all-reduce backward, sits at its input) and its second by input features (RowParallel: the g operator,
all-reduce forward and identity backward, sits at its output). One all-reduce forward, one backward.

Run: python examples/05_tensor_parallel.py   (2 CPU processes, gloo; about 15 s)
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import CommLedger
from polyshard.mesh.pool import WorkerPool
from polyshard.tp import ColumnParallel, RowParallel, parallelize


class MLP(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))  # (B, S, H) -> (B, S, 4H/tp) -> (B, S, H)


def tp_step() -> dict[str, object]:
    torch.manual_seed(0)
    reference = MLP()
    x = torch.randn(4, 8, 32, requires_grad=True)
    model = parallelize(
        copy.deepcopy(reference), tp_group=dist.group.WORLD, plan={"up": ColumnParallel(), "down": RowParallel()}
    )
    with CommLedger() as ledger:
        out = model(x)
        forward_calls = ledger.calls("all_reduce")
        out.square().mean().backward()
    reference(x.detach()).square().mean().backward()
    # Each rank holds rows (up) or columns (down) of the weights: compare its gradient with that slice.
    rank, tp = dist.get_rank(), dist.get_world_size()
    grad_diff = max(
        (model.up.weight.grad - reference.up.weight.grad.chunk(tp, 0)[rank]).abs().max().item(),
        (model.down.weight.grad - reference.down.weight.grad.chunk(tp, 1)[rank]).abs().max().item(),
    )
    return {
        "up.weight local": tuple(model.up.weight.shape),
        "down.weight local": tuple(model.down.weight.shape),
        "all-reduces forward": forward_calls,
        "all-reduces backward": ledger.calls("all_reduce") - forward_calls,
        "max |out - one process|": (out - reference(x.detach())).abs().max().item(),
        "max |grad - slice of one process's|": grad_diff,
    }


def main() -> None:
    pool = WorkerPool(2)
    try:
        for key, value in pool.run(tp_step)[0].items():
            print(f"{key:<38} {value:.1e}" if isinstance(value, float) else f"{key:<38} {value}")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
