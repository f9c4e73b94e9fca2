"""Benchmark (not a test): our schedules against torch.distributed.pipelining on the same model.

    polyshard bench pp --nproc 2 --json pp.json

For GPipe, 1F1B, interleaved 1F1B (v=2), ZB-V and DualPipeV it builds one MLP,
gives each rank its stages, and times one training step (forward + backward
over all microbatches) of ours and of PyTorch's ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B / ScheduleZBVZeroBubble / ScheduleDualPipeV,
interleaved in one process. Each record carries the ratio ours/peer, whether
losses and gradients match, and our measured bubble beside two predictions:
the simulator's on unit costs (``bubble_theory``) and the simulator's replay of
the compute times this run measured, each exchange keeping its rank busy for the
mean posting time measured and transfers free (``bubble_sim_measured``) - the
gap between that and the measured bubble is what waiting on peers and Python
between actions cost, split per rank into
``post``/``wait``/``other`` shares of the step. PyTorch's pipelining appears
only here, as the peer.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.bench.arguments import positive
from polyshard.bench.timing import (
    Record,
    comparison_record,
    held_bytes,
    run_bench,
    time_interleaved,
    write_records,
)
from polyshard.collectives import ops
from polyshard.mesh import DistributedContext
from polyshard.pp.actions import Schedule
from polyshard.pp.executor import PipelineExecutor, gather_timeline
from polyshard.pp.partition import build_stages
from polyshard.pp.schedules import make_schedule
from polyshard.pp.simulator import measured_costs, simulate
from polyshard.pp.timeline import Timeline

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

# float32 with the same microbatches; only the order of the gradient sums differs
# 1e-4, looser than the tests' 1e-5: the benchmark's shapes are 4-16x wider, so float32 sums taken
# in another order differ more (and the peer's kernels order them differently again).
MATCH_RTOL, MATCH_ATOL = 1e-4, 1e-6
PEERS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-v": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")  # peers built from one stage; the others take this rank's list of stages


def _layer(index: int, hidden: int) -> nn.Module:
    torch.manual_seed(index)
    return nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())


def _peer_schedule(
    name: str, modules: Mapping[int, nn.Module], num_stages: int, m: int
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    from torch.distributed import pipelining

    stages = [pipelining.PipelineStage(mod, s, num_stages, torch.device("cpu")) for s, mod in sorted(modules.items())]
    cls = getattr(pipelining, PEERS[name])  # looked up by name, so mypy cannot tell which schedule it builds
    peer = cls(stages[0] if name in SINGLE_STAGE else stages, n_microbatches=m, loss_fn=F.mse_loss)
    return cast("PipelineScheduleSingle | PipelineScheduleMulti", peer)


def _case(name: str, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> Record:
    p, rank = dist.get_world_size(), dist.get_rank()
    schedule = make_schedule(name, p, args.microbatches)  # interleaved v=2; V schedules two stages per rank
    virtual_stages = schedule.virtual_stages
    builders = [lambda i=i: _layer(i, args.hidden) for i in range(args.layers)]
    ours = build_stages(builders, schedule.num_stages, schedule.stages_of(rank))
    theirs = copy.deepcopy(ours)
    executor = PipelineExecutor(ours, schedule, F.mse_loss, prefetch=getattr(args, "prefetch", None))
    peer = _peer_schedule(name, theirs, schedule.num_stages, args.microbatches)
    first, last = 0 in ours, schedule.num_stages - 1 in ours
    state: dict[str, Any] = {}  # "ours": our StepResult, "peer_loss": the peer's loss (None off the last stage)

    def run_ours() -> None:
        for mod in ours.values():
            mod.zero_grad()
        state["ours"] = executor.step(x if first else None, y if last else None)

    def run_peer() -> None:
        for mod in theirs.values():
            mod.zero_grad()
        losses: list[torch.Tensor] = []
        peer.step(*([x] if first else []), target=y if last else None, losses=losses)
        state["peer_loss"] = torch.stack(losses).mean() if losses else None

    ours_s, peer_s = time_interleaved(run_ours, run_peer, group=dist.group.WORLD, iters=args.iters, warmup=2)
    match = _matches(state, ours, theirs, last)
    case = f"{name} p={p} m={args.microbatches}" + (f" v={virtual_stages}" if virtual_stages > 1 else "")
    theory = simulate(schedule).bubble_fraction
    timeline = _median_timeline(run_ours, lambda: state["ours"].timeline, schedule, executor)
    if args.svg and rank == 0:
        with open(f"{args.svg}/{name}.svg", "w") as f:
            f.write(timeline.to_svg(title=f"{case} (measured)", predicted_bubble=theory))
    extra = _bubbles(timeline, schedule, executor)
    if getattr(args, "ab_prefetch", False):  # the same stages with receives posted just before use
        late = PipelineExecutor(ours, schedule, F.mse_loss, prefetch=0)

        def run_late() -> None:
            for mod in ours.values():
                mod.zero_grad()
            state["late"] = late.step(x if first else None, y if last else None)

        ab_ours_s, late_s = time_interleaved(run_ours, run_late, group=dist.group.WORLD, iters=args.iters, warmup=2)
        late_timeline = _median_timeline(run_late, lambda: state["late"].timeline, schedule, late)
        extra |= {"late_s": late_s, "ab_ratio": ab_ours_s / late_s, "bubble_late": late_timeline.bubble_fraction}
    extra |= {"ours_held_bytes": held_bytes(ours.values()), "peer_held_bytes": held_bytes(theirs.values())}
    return comparison_record(case, ours_s, peer_s, match, **extra, bubble_theory=theory)


def _median_timeline(
    run: Callable[[], None], local: Callable[[], Timeline], schedule: Schedule, executor: PipelineExecutor
) -> Timeline:
    """A single step's bubble is noisy on a shared machine: the gathered timeline of the median of three."""
    timelines = []
    for _ in range(3):
        run()
        timelines.append(gather_timeline(local(), schedule, program=executor.program))
    return sorted(timelines, key=lambda t: t.bubble_fraction)[1]


def _bubbles(timeline: Timeline, schedule: Schedule, executor: PipelineExecutor) -> dict[str, float]:
    """The measured bubble, the simulator's replay of the measured compute and posting times (free
    transfers), and where each step's time went, as shares of ranks x step time."""
    measured = {span.label: span.end - span.start for span in timeline.spans if span.kind not in ("X", "R")}
    post = measured_costs(timeline)["post"]  # each exchange keeps its rank busy this long (gloo's calls)
    replay = simulate(schedule, lambda action: measured[str(action)], post_cost=post, program=executor.program)
    parts = [timeline.breakdown(r) for r in range(schedule.num_ranks)]
    whole = schedule.num_ranks * timeline.total_time
    shares = {f"share_{key}": sum(part[key] for part in parts) / whole for key in ("post", "wait", "other")}
    return {"bubble_measured": timeline.bubble_fraction, "bubble_sim_measured": replay.bubble_fraction, **shares}


def _matches(state: dict[str, Any], ours: Mapping[int, nn.Module], theirs: Mapping[int, nn.Module], last: bool) -> bool:
    ok = True
    if last:
        ok = torch.allclose(state["ours"].loss, state["peer_loss"], rtol=MATCH_RTOL, atol=MATCH_ATOL)
    for s in ours:
        for a, b in zip(ours[s].parameters(), theirs[s].parameters()):
            # Both ran a backward, so every gradient is set.
            ok = ok and torch.allclose(
                cast(torch.Tensor, a.grad), cast(torch.Tensor, b.grad), rtol=MATCH_RTOL, atol=MATCH_ATOL
            )
    flag = torch.tensor([1.0 if ok else 0.0])
    ops.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank agrees on the verdict
    return bool(flag.item())


def compare(
    schedules: Sequence[str] = tuple(PEERS),
    *,
    layers: int = 8,
    hidden: int = 1024,
    batch: int = 64,
    microbatches: int = 8,
    iters: int = 20,
) -> list[Record]:
    """One record per schedule against its PyTorch peer on the world group (call on every rank);
    the defaults are ``main``'s."""
    args = argparse.Namespace(
        layers=layers, hidden=hidden, batch=batch, microbatches=microbatches, iters=iters, svg=None
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)
    return [_case(name, args, x, y) for name in schedules]


def parser() -> argparse.ArgumentParser:
    """The flags of ``main``; ``polyshard bench pp`` checks them before any process starts."""
    parser = argparse.ArgumentParser(prog="polyshard bench pp", description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the records to this file (rank 0)")
    parser.add_argument("--layers", type=positive, default=8)
    parser.add_argument("--hidden", type=positive, default=1024)
    parser.add_argument("--batch", type=positive, default=64)
    parser.add_argument("--microbatches", type=positive, default=8)
    parser.add_argument("--iters", type=positive, default=20)
    parser.add_argument("--schedules", default=",".join(PEERS))
    parser.add_argument(
        "--prefetch", type=int, default=None, help="post receives this many actions ahead (default: the executor's)"
    )
    parser.add_argument(
        "--ab-prefetch", action="store_true", help="also time ours with receives posted just before use (prefetch 0)"
    )
    parser.add_argument("--svg", default=None, help="folder for one measured timeline SVG per schedule")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)

    def measure(ctx: DistributedContext) -> list[Record]:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(args.batch, args.hidden, generator=g), torch.randn(args.batch, args.hidden, generator=g)
        return [_case(name, args, x, y) for name in args.schedules.split(",")]

    def report(records: list[Record]) -> None:
        write_records(records, args.json)
        for r in records:
            if "late_s" in r:
                print(
                    f"{r['case']:<40} receives posted just before use: {r['late_s'] * 1e3:.1f} ms, ours/late "
                    f"{r['ab_ratio']:.2f}, bubble {r['bubble_late']:.3f}"
                )
            print(
                f"{r['case']:<40} bubble measured {r['bubble_measured']:.3f}  simulator on measured costs "
                f"{r['bubble_sim_measured']:.3f}  theory {r['bubble_theory']:.3f}  | step shares: post "
                f"{r['share_post']:.3f} wait {r['share_wait']:.3f} other {r['share_other']:.3f}"
            )

    run_bench(measure, report)


if __name__ == "__main__":
    main()
