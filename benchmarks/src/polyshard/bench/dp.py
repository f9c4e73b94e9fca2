"""Benchmark (not a test): our DataParallel vs torch DDP, ZeRO-1 vs ``ZeroRedundancyOptimizer``, ZeRO-3 vs FSDP2,
and on 4 or more ranks (an even number) hybrid ZeRO-3 (shard groups of 2) vs FSDP2's HSDP on a 2-D DeviceMesh.

Same model, batch, bucket size and world size; the two sides' training steps
run interleaved (``polyshard.bench.timing.time_interleaved``). Before
timing, each pair trains a few steps from the same weights on the same data
and the losses are compared. Memory: CPU has no per-case peak counter, so the
records carry the bytes each rank *holds* after a step (parameters, gradients,
optimizer state), counted from the live tensors on both sides.

``--memory`` skips the timings and prints, for fp32 AdamW, the bytes each rank
holds after a step at stages 0-3 against the ZeRO paper's formulas, and
DDP + ``ZeroRedundancyOptimizer``'s for ZeRO-1, counted from distinct storages
on both sides (:func:`polyshard.dp.bytes_held`, :func:`polyshard.dp.storage_bytes`).

    polyshard bench dp --nproc 2 --json out.json
    python -m torch.distributed.run --nproc-per-node 2 -m polyshard.bench.dp
    python -m torch.distributed.run --nproc-per-node 2 -m polyshard.bench.dp --memory
    python -m torch.distributed.run --nproc-per-node 4 -m polyshard.bench.dp     # adds the HSDP row
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.bench.arguments import positive
from polyshard.bench.timing import (
    Column,
    Record,
    comparison_record,
    held_bytes,
    run_bench,
    time_interleaved,
    write_records,
)
from polyshard.dp import DataParallel, FullyShardedDataParallel, MemoryReport, ZeroOptimizer, bytes_held, storage_bytes
from polyshard.mesh import DistributedContext, Mesh

HIDDEN, DEPTH, BATCH_PER_RANK, LR = 512, 4, 32, 1e-3
CHECK_STEPS = 3
# Both sides run fp32 on the same data; they sum gradients in different orders
# and buckets, so losses agree to float32 rounding amplified over a few steps.
# 1e-4, looser than the tests' 1e-5: the benchmark's shapes are 4-16x wider, so float32 sums taken
# in another order differ more (and the peer's kernels order them differently again).
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(DEPTH)])


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(BATCH_PER_RANK, HIDDEN, generator=g), torch.randn(BATCH_PER_RANK, HIDDEN, generator=g)


def step_fn(
    model: nn.Module, optimizer: torch.optim.Optimizer | ZeroOptimizer, finish: Callable[[], None] | None = None
) -> Callable[[], float]:
    """One training step on a fixed batch; returns the local loss."""
    x, y = make_batch(0)

    def step() -> float:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if finish is not None:
            finish()
        optimizer.step()
        return loss.item()

    return step


def _world() -> dist.ProcessGroup:
    return cast(dist.ProcessGroup, dist.group.WORLD)  # typed Optional; initialised here


def losses_match(ours: Callable[[], float], peer: Callable[[], float]) -> bool:
    ours_losses = torch.tensor([ours() for _ in range(CHECK_STEPS)])
    peer_losses = torch.tensor([peer() for _ in range(CHECK_STEPS)])
    return bool(torch.allclose(ours_losses, peer_losses, rtol=LOSS_RTOL, atol=LOSS_ATOL))


def bench_ddp(iters: int) -> Record:
    from torch.nn.parallel import DistributedDataParallel

    ours_model = DataParallel(make_model(), group=_world(), bucket_cap_mb=25)
    peer_model = DistributedDataParallel(make_model(), bucket_cap_mb=25)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=LR)
    peer_opt = torch.optim.AdamW(peer_model.parameters(), lr=LR)
    ours = step_fn(ours_model, ours_opt, ours_model.finish_grad_sync)
    peer = step_fn(peer_model, peer_opt)
    match = losses_match(ours, peer)
    ours_s, peer_s = time_interleaved(ours, peer, group=dist.group.WORLD, iters=iters, warmup=2)
    return comparison_record(
        f"DataParallel vs DDP dp={dist.get_world_size()}",
        ours_s,
        peer_s,
        match,
        ours_held_bytes=bytes_held(ours_model, ours_opt).total,
        peer_held_bytes=held_bytes([peer_model], [peer_opt]),
    )


def bench_zero1(iters: int) -> Record:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ours_model = DataParallel(make_model(), group=_world(), bucket_cap_mb=25, zero_stage=1)
    ours_opt = ZeroOptimizer(torch.optim.AdamW(ours_model.parameters(), lr=LR), ours_model)
    peer_model = DistributedDataParallel(make_model(), bucket_cap_mb=25)
    peer_opt = ZeroRedundancyOptimizer(peer_model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    ours, peer = step_fn(ours_model, ours_opt), step_fn(peer_model, peer_opt)
    match = losses_match(ours, peer)
    ours_s, peer_s = time_interleaved(ours, peer, group=dist.group.WORLD, iters=iters, warmup=2)
    return comparison_record(
        f"ZeRO-1 vs DDP+ZeroRedundancyOptimizer dp={dist.get_world_size()}",
        ours_s,
        peer_s,
        match,
        ours_held_bytes=bytes_held(ours_model, ours_opt).total,
        peer_held_bytes=held_bytes([peer_model], [peer_opt.optim]),
    )


def _against_fsdp2(case: str, ours_model: FullyShardedDataParallel, device_mesh: Any, iters: int) -> Record:
    """``ours_model`` against the same model under FSDP2's ``fully_shard`` (per block, then the root) on
    ``device_mesh``: a 1-D mesh shards over it, a 2-D one replicates over dim 0 and shards over dim 1."""
    from torch.distributed.fsdp import fully_shard

    ours_opt = ZeroOptimizer(torch.optim.AdamW(ours_model.parameters(), lr=LR), ours_model)
    peer_model = make_model()
    for block in peer_model:
        fully_shard(block, mesh=device_mesh)
    fully_shard(peer_model, mesh=device_mesh)
    peer_opt = torch.optim.AdamW(peer_model.parameters(), lr=LR)
    ours, peer = step_fn(ours_model, ours_opt), step_fn(peer_model, peer_opt)
    match = losses_match(ours, peer)
    ours_s, peer_s = time_interleaved(ours, peer, group=dist.group.WORLD, iters=iters, warmup=2)
    return comparison_record(
        case,
        ours_s,
        peer_s,
        match,
        ours_held_bytes=bytes_held(ours_model, ours_opt).total,
        peer_held_bytes=held_bytes([peer_model], [peer_opt]),
    )


def bench_fsdp(iters: int) -> Record:
    from torch.distributed.device_mesh import init_device_mesh

    ours_model = FullyShardedDataParallel(make_model(), group=_world())
    device_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return _against_fsdp2(f"ZeRO-3 vs FSDP2 dp={dist.get_world_size()}", ours_model, device_mesh, iters)


HSDP_SHARD = 2
"""Ranks per shard group in the hybrid case: neighbouring ranks, as ``dp_replicate x dp_shard`` lays them out."""


def bench_hsdp(iters: int) -> Record:
    """Hybrid ZeRO-3 (shard inside groups of :data:`HSDP_SHARD`, all-reduce across them) vs FSDP2's HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    replicas = world // HSDP_SHARD
    mesh = Mesh({"dp_replicate": replicas, "dp_shard": HSDP_SHARD})
    ours_model = FullyShardedDataParallel(
        make_model(),
        group=mesh.group("dp_shard"),
        replicate_group=mesh.group("dp_replicate"),
        axis="dp_shard",
        replicate_axis="dp_replicate",
    )
    device_mesh = init_device_mesh("cpu", (replicas, HSDP_SHARD), mesh_dim_names=("dp_replicate", "dp_shard"))
    case = f"hybrid ZeRO-3 vs FSDP2 HSDP dp={world} (dp_shard={HSDP_SHARD})"
    return _against_fsdp2(case, ours_model, device_mesh, iters)


def run_all(iters: int) -> list[Record]:
    """DDP, ZeRO-1 and ZeRO-3 against their peers on the world group, and hybrid ZeRO-3 against HSDP
    where the world splits into shard groups (call on every rank)."""
    records = [bench_ddp(iters), bench_zero1(iters), bench_fsdp(iters)]
    world = dist.get_world_size()
    if world > HSDP_SHARD and world % HSDP_SHARD == 0:
        records.append(bench_hsdp(iters))
    return records


# Bytes per parameter with fp32 parameters, gradients and AdamW (m, v: K = 8, no master copy needed),
# (params, grads, optimizer state) as functions of N: the ZeRO paper's accounting (1910.02054, 3.1).
FP32_ADAM: dict[int, Callable[[int], tuple[float, float, float]]] = {
    0: lambda n: (4.0, 4.0, 8.0),  # 16Ψ
    1: lambda n: (4.0, 4.0, 8 / n),  # 8Ψ + 8Ψ/N
    2: lambda n: (4.0, 4 / n, 8 / n),  # 4Ψ + 12Ψ/N
    3: lambda n: (4 / n, 4 / n, 8 / n),  # 16Ψ/N
}

MEMORY_COLUMNS: tuple[Column, ...] = (
    ("case", 40, lambda r: r["case"]),
    ("params", 12, lambda r: f"{r['params']:,}"),
    ("grads", 12, lambda r: f"{r['grads']:,}"),
    ("optimizer", 12, lambda r: f"{r['optimizer_state']:,}"),
    ("total", 12, lambda r: f"{r['total']:,}"),
    ("total/Ψ", 9, lambda r: f"{r['total'] / r['psi']:.3f}"),
    ("paper/Ψ", 9, lambda r: f"{r['paper'] / r['psi']:.3f}"),
)


def _memory_record(case: str, report: MemoryReport, psi: int, paper: float) -> Record:
    """The largest figures over the ranks (the peer's ranks may own different amounts)."""
    mine = [report.params, report.grads, report.optimizer_state]
    every: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    params, grads, state = (max(column) for column in zip(*every))
    total = max(sum(r) for r in every)
    return {
        "case": case,
        "params": params,
        "grads": grads,
        "optimizer_state": state,
        "total": total,
        "psi": psi,
        "paper": paper,
    }


def memory_records() -> list[Record]:
    """Bytes held per rank after one fp32 AdamW step (gradients still held), ours at stages 0-3 and
    DDP + ZeroRedundancyOptimizer, against :data:`FP32_ADAM`."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    n = dist.get_world_size()
    records = []
    for stage in range(4):
        if stage == 3:
            model: DataParallel | FullyShardedDataParallel = FullyShardedDataParallel(make_model(), group=_world())
        else:
            model = DataParallel(make_model(), group=_world(), zero_stage=stage)
        inner = torch.optim.AdamW(model.parameters(), lr=LR)
        opt: torch.optim.Optimizer | ZeroOptimizer = inner if stage == 0 else ZeroOptimizer(inner, model)
        step_fn(model, opt, model.finish_grad_sync)()
        psi = sum(p.numel() for p in model.module.parameters())
        paper = sum(FP32_ADAM[stage](n)) * psi
        records.append(_memory_record(f"ZeRO-{stage} dp={n}", bytes_held(model, opt), psi, paper))
    # The peer: gradients as views of DDP's buckets, so counting storages counts the buckets once.
    peer_model = DistributedDataParallel(make_model(), gradient_as_bucket_view=True)
    peer_opt = ZeroRedundancyOptimizer(peer_model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    step_fn(peer_model, peer_opt)()
    seen: set[int] = set()
    params = storage_bytes(peer_model.parameters(), seen)
    grads = storage_bytes((p.grad for p in peer_model.parameters() if p.grad is not None), seen)
    state = [v for s in peer_opt.optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    psi = sum(p.numel() for p in peer_model.parameters())
    peer = MemoryReport(params, grads, storage_bytes(state, seen))
    records.append(_memory_record(f"DDP+ZeroRedundancyOptimizer dp={n}", peer, psi, sum(FP32_ADAM[1](n)) * psi))
    return records


def parser() -> argparse.ArgumentParser:
    """The flags of ``main``; ``polyshard bench dp`` checks them before any process starts."""
    parser = argparse.ArgumentParser(prog="polyshard bench dp", description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the records to this file")
    parser.add_argument("--iters", type=positive, default=10, help="timed steps per side")
    parser.add_argument("--memory", action="store_true", help="only the bytes held per rank (fp32 AdamW)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)

    def measure(ctx: DistributedContext) -> list[Record]:
        torch.set_num_threads(1)  # ranks share the machine's cores
        if args.memory:
            return memory_records()
        return run_all(args.iters)

    def report(records: list[Record]) -> None:
        if args.memory:
            write_records(records, args.json, MEMORY_COLUMNS)
            return
        write_records(records, args.json)
        for r in records:
            print(f"{r['case']}: held bytes per rank ours {r['ours_held_bytes']:,} peer {r['peer_held_bytes']:,}")

    run_bench(measure, report)


if __name__ == "__main__":
    main()
