"""Benchmark (not a test): where a step's time goes, ours against the PyTorch peer, op by op.

    python -m torch.distributed.run --nproc-per-node 2 -m polyshard.bench.pprof --case composed
    python -m torch.distributed.run --nproc-per-node 2 -m polyshard.bench.pprof --case pp:interleaved
    python -m torch.distributed.run --nproc-per-node 2 -m polyshard.bench.pprof --case zero1

A single wall-clock ratio on a shared machine says little; this prints what each side does per
step, which a busy machine does not change: for each rank, ``torch.profiler`` (CPU) over
``--steps`` steps of ours, then of the peer, and per step the count and self CPU time of each
operator, the operators whose counts differ first, then the heaviest. ``python`` is the step's wall
time less the operators' self time: Python between operators (and time the process was not
scheduled). An interleaved A/B median (``time_interleaved``) is printed beside them.

Cases: ``composed`` (the composed GPT-tiny pp2 1F1B m=4 row of ``polyshard bench peers``: ours
:func:`~polyshard.trainer.loop.train_step`, the peer ``PipelineStage`` + ``Schedule1F1B``;
``composed:<shape>:<dp2|tp2|pp2>`` another of its rows, e.g. ``composed:titan-debug:tp2``),
``pp:<schedule>`` (``polyshard bench pp``'s row for gpipe, 1f1b, interleaved, zb-v or dualpipev),
``zero1`` (``polyshard bench dp``'s ZeRO-1 row against DDP + ``ZeroRedundancyOptimizer``),
``ab:packed`` (ours on the composed row against ours with its one-rank gradient buckets packed and
all-reduced as before they were solo; ``polyshard.dp.buckets``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from polyshard.bench.timing import Record, run_bench, time_interleaved
from polyshard.mesh import DistributedContext

Step = Callable[[], object]


def composed_sides(preset: str = "tiny", layout: str = "pp2") -> tuple[Step, Step]:
    """A composed row of ``bench peers`` on 2 ranks: the shape ``preset`` on ``layout`` (dp2, tp2 or pp2)."""
    from polyshard.bench import peers

    if preset not in peers.SHAPES or layout not in ("dp2", "tp2", "pp2"):
        raise SystemExit(f"--case composed:<{'|'.join(peers.SHAPES)}>:<dp2|tp2|pp2>, not {preset!r}:{layout!r}")
    config = peers.composed_config({layout[:2]: 2}, preset)
    device = torch.device("cpu")
    ours, peer = peers.Ours(config, device), peers.Peer(config, device)
    data_rank = ours.mesh.group_rank(config.parallel.batch_axes)
    data = peers.batches(config, data_rank, 1)[0]
    return lambda: ours.step(*data), lambda: peer.step(*data)


def packed_sides() -> tuple[Step, Step]:
    """An A/B of ours on the composed pp2 row: as it is (dp=1, so its gradient buckets are solo and leave
    the gradients in ``p.grad``) against the same engine with every bucket packed, all-reduced over the
    one rank and unpacked, as before solo buckets (printed in the "peer" columns)."""
    from polyshard.bench import peers
    from polyshard.dp import buckets

    config = peers.composed_config({"pp": 2})
    device = torch.device("cpu")
    ours = peers.Ours(config, device)
    plain_init = buckets.Bucket.__init__

    def packed_init(self: buckets.Bucket, *args: Any, **kwargs: Any) -> None:
        plain_init(self, *args, **kwargs)
        self.solo = False

    buckets.Bucket.__init__ = packed_init  # type: ignore[method-assign]
    try:
        packed = peers.Ours(config, device)
    finally:
        buckets.Bucket.__init__ = plain_init  # type: ignore[method-assign]
    data_rank = ours.mesh.group_rank(config.parallel.batch_axes)
    data = peers.batches(config, data_rank, 1)[0]
    return lambda: ours.step(*data), lambda: packed.step(*data)


def pp_sides(name: str) -> tuple[Step, Step]:
    """``bench pp``'s row for schedule ``name`` at ``bench peers``' shapes (8 layers, 8 microbatches)."""
    import copy

    import torch.nn.functional as F

    from polyshard.bench import pp
    from polyshard.pp.executor import PipelineExecutor
    from polyshard.pp.partition import build_stages
    from polyshard.pp.schedules import make_schedule

    layers, hidden, batch, m = 8, 1024, 64, 8
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)
    schedule = make_schedule(name, dist.get_world_size(), m)
    rank = dist.get_rank()
    builders = [lambda i=i: pp._layer(i, hidden) for i in range(layers)]
    ours = build_stages(builders, schedule.num_stages, schedule.stages_of(rank))
    theirs = copy.deepcopy(ours)
    executor = PipelineExecutor(ours, schedule, F.mse_loss)
    peer = pp._peer_schedule(name, theirs, schedule.num_stages, m)
    first, last = 0 in ours, schedule.num_stages - 1 in ours

    def run_ours() -> None:
        for mod in ours.values():
            mod.zero_grad()
        executor.step(x if first else None, y if last else None)

    def run_peer() -> None:
        for mod in theirs.values():
            mod.zero_grad()
        peer.step(*([x] if first else []), target=y if last else None, losses=[])

    return run_ours, run_peer


def zero1_sides() -> tuple[Step, Step]:
    """``bench dp``'s ZeRO-1 row: our DataParallel(zero_stage=1) + ZeroOptimizer against DDP +
    ZeroRedundancyOptimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from polyshard.bench import dp
    from polyshard.dp import DataParallel, ZeroOptimizer

    world = dp._world()
    ours_model = DataParallel(dp.make_model(), group=world, bucket_cap_mb=25, zero_stage=1)
    ours_opt = ZeroOptimizer(torch.optim.AdamW(ours_model.parameters(), lr=dp.LR), ours_model)
    peer_model = DistributedDataParallel(dp.make_model(), bucket_cap_mb=25)
    peer_opt = ZeroRedundancyOptimizer(peer_model.parameters(), optimizer_class=torch.optim.AdamW, lr=dp.LR)
    return dp.step_fn(ours_model, ours_opt), dp.step_fn(peer_model, peer_opt)


def sides(case: str) -> tuple[Step, Step]:
    if case == "composed" or case.startswith("composed:"):
        return composed_sides(*case.split(":")[1:])
    if case.startswith("pp:"):
        return pp_sides(case[3:])
    if case == "zero1":
        return zero1_sides()
    if case == "ab:packed":
        return packed_sides()
    raise SystemExit(f"--case takes composed, pp:<schedule>, zero1 or ab:packed, not {case!r}")


def op_profile(step: Step, steps: int) -> dict[str, Any]:
    """Per step: each operator's (count, self CPU µs), and the wall time and the operators' total."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) / steps
    table: dict[str, tuple[float, float]] = {}
    for event in prof.key_averages():
        # record_function ranges (torch pipelining's "PP:1F3", "Optimizer.step#AdamW.step") are not
        # operators: their self time is the Python inside them, which "python" below counts
        if not getattr(event, "is_user_annotation", False):
            table[event.key] = (event.count / steps, event.self_cpu_time_total / steps)
    ops_us = sum(us for _, us in table.values())
    return {"ops": table, "wall_us": wall * 1e6, "ops_us": ops_us}


def python_profile(step: Step, steps: int, top: int) -> str:
    """cProfile's heaviest functions by own time over ``steps`` steps (this rank)."""
    import cProfile
    import io
    import pstats

    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def measure(args: argparse.Namespace) -> list[Record]:
    torch.set_num_threads(1)  # ranks share the machine's cores, as every bench does
    ours, peer = sides(args.case)
    ours_s, peer_s = time_interleaved(ours, peer, group=dist.group.WORLD, iters=args.iters, warmup=2)
    record: Record = {"case": args.case, "ours_s": ours_s, "peer_s": peer_s, "rank": dist.get_rank()}
    record["ours"] = op_profile(ours, args.steps)
    record["peer"] = op_profile(peer, args.steps)
    if args.python:
        record["ours_python"] = python_profile(ours, args.steps, args.python)
        record["peer_python"] = python_profile(peer, args.steps, args.python)
    every: list[Record | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, record)
    return [r for r in every if r is not None]


def format_rank(r: Record, top: int) -> str:
    ours, peer = r["ours"]["ops"], r["peer"]["ops"]
    lines = [
        f"rank {r['rank']}  per step: wall ours {r['ours']['wall_us'] / 1e3:.2f} ms, peer "
        f"{r['peer']['wall_us'] / 1e3:.2f} ms (under the profiler); operators' self time ours "
        f"{r['ours']['ops_us'] / 1e3:.2f} ms, peer {r['peer']['ops_us'] / 1e3:.2f} ms; python ours "
        f"{(r['ours']['wall_us'] - r['ours']['ops_us']) / 1e3:.2f} ms, peer "
        f"{(r['peer']['wall_us'] - r['peer']['ops_us']) / 1e3:.2f} ms; operator calls ours "
        f"{sum(c for c, _ in ours.values()):.0f}, peer {sum(c for c, _ in peer.values()):.0f}",
        f"  {'operator':<52}{'ours n':>9}{'peer n':>9}{'ours ms':>10}{'peer ms':>10}",
    ]
    keys = set(ours) | set(peer)

    def row(key: str) -> str:
        (on, ot), (pn, pt) = ours.get(key, (0.0, 0.0)), peer.get(key, (0.0, 0.0))
        return f"  {key[:52]:<52}{on:>9.1f}{pn:>9.1f}{ot / 1e3:>10.3f}{pt / 1e3:>10.3f}"

    by_time = sorted(keys, key=lambda k: -max(ours.get(k, (0, 0))[1], peer.get(k, (0, 0))[1]))
    lines += [row(k) for k in by_time[:top]]
    differ = [k for k in keys if k not in by_time[:top] and ours.get(k, (0, 0))[0] != peer.get(k, (0, 0))[0]]
    differ.sort(key=lambda k: -abs(ours.get(k, (0, 0))[0] - peer.get(k, (0, 0))[0]))
    if differ:
        lines.append("  -- counts that differ, lighter operators:")
        lines += [row(k) for k in differ[:top]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="composed", help="composed[:<shape>:<layout>], pp:<schedule>, zero1")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per side")
    parser.add_argument("--iters", type=int, default=20, help="interleaved timed steps per side")
    parser.add_argument("--top", type=int, default=25, help="operators shown per rank")
    parser.add_argument("--python", type=int, default=0, help="also print cProfile's N heaviest functions")
    args = parser.parse_args(argv)

    def run(ctx: DistributedContext) -> list[Record]:
        return measure(args)

    def report(records: list[Record]) -> None:
        first = records[0]
        print(
            f"{args.case}: interleaved medians ours {first['ours_s'] * 1e3:.2f} ms, peer {first['peer_s'] * 1e3:.2f} "
            f"ms, ratio {first['ours_s'] / first['peer_s']:.3f} ({args.iters} steps each, slowest rank)"
        )
        for r in records:
            print(format_rank(r, args.top))
            for side in ("ours", "peer"):
                if f"{side}_python" in r:
                    print(f"rank {r['rank']} {side} cProfile:\n{r[f'{side}_python']}")

    run_bench(run, report)


if __name__ == "__main__":
    main()
