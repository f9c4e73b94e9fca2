"""Learning path 3: data parallelism - each rank takes a slice of the batch; gradients are averaged in
buckets that reduce while backward is still running.

Run: python examples/03_data_parallel.py   (2 CPU processes, gloo; about 15 s)
"""

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import CommLedger
from polyshard.dp import DataParallel
from polyshard.mesh.pool import WorkerPool

BATCH = 16


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 8, generator=g)


def reference_grads() -> dict[str, torch.Tensor]:
    """One process, the whole batch."""
    model = make_model()
    x, y = data()
    nn.functional.mse_loss(model(x), y).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def data_parallel_step(bucket_cap_mb: float) -> dict[str, float]:
    rank, n = dist.get_rank(), dist.get_world_size()
    model = DataParallel(make_model(), group=dist.group.WORLD, bucket_cap_mb=bucket_cap_mb)
    x, y = (t.chunk(n)[rank] for t in data())  # this rank's rows
    with CommLedger() as ledger:
        nn.functional.mse_loss(model(x), y).backward()  # buckets start reducing as their grads are ready
        started_in_backward = ledger.calls("all_reduce")
        model.finish_grad_sync()  # wait for the last bucket; every grad is now the average
    expected = reference_grads()
    worst = max((p.grad - expected[name]).abs().max().item() for name, p in model.module.named_parameters())
    return {
        "buckets": len(model.buckets()),
        "all_reduce calls": ledger.calls("all_reduce"),
        "started during backward": started_in_backward,
        "bytes reduced": ledger.total("all_reduce"),
        "max |grad - one process|": worst,
    }


def main() -> None:
    params = sum(p.numel() for p in make_model().parameters())
    print(f"model: {params} parameters ({params * 4} bytes of fp32 gradients), batch {BATCH} over 2 ranks")
    pool = WorkerPool(2)
    try:
        for cap_mb in (25, 0.01):
            result = pool.run(data_parallel_step, cap_mb)[0]
            print(
                f"bucket_cap_mb={cap_mb}: "
                + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
            )
    finally:
        pool.close()


if __name__ == "__main__":
    main()
