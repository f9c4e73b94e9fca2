"""Learning path 4: ZeRO 1/2/3 - shard the optimizer state, then the gradients, then the parameters.

Bytes one rank holds for fp32 AdamW with Ψ parameters on N ranks (ZeRO paper, 1910.02054, section 3.1):
plain DP 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N. The example measures the bytes
behind the live tensors (polyshard.dp.bytes_held) after one step and prints them beside the formula.

Run: python examples/04_zero.py   (2 CPU processes, gloo; about 15 s)
"""

import torch
import torch.distributed as dist
from torch import nn

from polyshard.dp import DataParallel, FullyShardedDataParallel, ZeroOptimizer, bytes_held
from polyshard.mesh.pool import WorkerPool

# Formula bytes per parameter for (params, grads, optimizer state) at each stage, fp32 AdamW.
PAPER = {0: (4, 4, 8), 1: (4, 4, 8 / 2), 2: (4, 4 / 2, 8 / 2), 3: (4 / 2, 4 / 2, 8 / 2)}  # N = 2


def make_model() -> nn.Sequential:
    torch.manual_seed(0)  # every dim 0 even, so no ZeRO padding at N = 2
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def held(stage: int) -> tuple[int, int, int]:
    model = make_model()
    if stage == 3:
        wrapped = FullyShardedDataParallel(model, group=dist.group.WORLD)
    else:
        wrapped = DataParallel(model, group=dist.group.WORLD, zero_stage=stage)
    optimizer = ZeroOptimizer(torch.optim.AdamW(wrapped.parameters(), lr=1e-3), wrapped)
    x = torch.randn(4, 16)
    wrapped(x).square().mean().backward()
    wrapped.finish_grad_sync()
    optimizer.step()
    report = bytes_held(wrapped, optimizer)
    return report.params, report.grads, report.optimizer_state


def main() -> None:
    psi = sum(p.numel() for p in make_model().parameters())
    print(f"Ψ = {psi} parameters, N = 2 ranks, fp32 AdamW; bytes on rank 0 after one step")
    print(f"{'stage':<6}{'params':>9}{'grads':>9}{'state':>9}{'total':>9}{'formula':>9}{'formula/Ψ':>11}")
    pool = WorkerPool(2)
    try:
        for stage in range(4):
            params, grads, state = pool.run(held, stage)[0]
            formula = sum(PAPER[stage]) * psi
            total = params + grads + state
            print(f"{stage:<6}{params:>9}{grads:>9}{state:>9}{total:>9}{formula:>9.0f}{sum(PAPER[stage]):>11.1f}")
    finally:
        pool.close()
    print(
        "(what exceeds the formula: one presence flag per parameter tensor in each gradient row, AdamW's step scalars)"
    )


if __name__ == "__main__":
    main()
