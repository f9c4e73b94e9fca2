"""Benchmark (not a test): the expert-parallel MoE layer against the same layer on one process.

    polyshard bench ep --nproc 2 --json ep.json
    python -m polyshard.bench.ep              (one process: only :mod:`polyshard.bench.ep_experts`)

On rank 0 it first runs :mod:`polyshard.bench.ep_experts` (grouped experts against a loop, the
layer against a torch-ops MoE), then, on two or more ranks, the expert-parallel cases below.

The peer (the issue's choice) is the same :class:`MoELayer` without expert
parallelism: one process holds all E experts and loops over them on the
tokens of every rank. Ours spreads the experts over the P ranks and exchanges
tokens with all-to-all. Each timed call is one forward + backward (+ gradient
sync for ours) over the union of P x T tokens, so both columns process the
same work and ``tokens_per_s`` compares directly. ``all_to_all_fraction`` is
the share of our step spent inside the all-to-all calls (waiting for slower
ranks included), measured by timing ``polyshard.collectives.ops.all_to_all``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.bench import ep_experts
from polyshard.bench.arguments import at_least, positive
from polyshard.bench.timing import (
    Record,
    comparison_record,
    held_bytes,
    run_bench,
    time_interleaved,
    write_records,
)
from polyshard.collectives import ops
from polyshard.ep.parallel import apply_expert_parallel, sync_gradients
from polyshard.mesh.init import DistributedContext
from polyshard.models.common.moe.config import MoEConfig
from polyshard.models.common.moe.layer import MoELayer

# float32; each expert sees the same rows, split into different matmuls: ulp-level differences.
# 1e-4, looser than the tests' 1e-5: the benchmark's shapes are 4-16x wider, so float32 sums taken
# in another order differ more (and the peer's kernels order them differently again).
MATCH_RTOL, MATCH_ATOL = 1e-4, 1e-5


@contextlib.contextmanager
def timed_all_to_all(totals: list[float]) -> Iterator[None]:
    """Time every ``ops.all_to_all`` call (the autograd all-to-all and the counts exchange use it)."""
    original = ops.all_to_all

    def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = original(*args, **kwargs)
        totals.append(time.perf_counter() - start)
        return out

    ops.all_to_all = timed
    try:
        yield
    finally:
        ops.all_to_all = original


def _step(
    layer: nn.Module, x: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    layer.zero_grad(set_to_none=True)
    y, aux = layer(x)
    ((y * target).sum(dim=-1).mean() + aux).backward()
    if group is not None:
        sync_gradients(layer, group)
    return y.detach()  # type: ignore[no-any-return]  # nn.Module.__call__ returns Any in torch's stubs


def _case(args: argparse.Namespace, top_k: int) -> Record:
    p, rank = dist.get_world_size(), dist.get_rank()
    group = cast(dist.ProcessGroup, dist.group.WORLD)  # typed Optional; initialised here
    torch.manual_seed(0)
    config = MoEConfig(ffn_hidden=args.ffn, num_experts=args.experts, top_k=top_k)
    peer_layer = MoELayer(config, hidden=args.hidden)
    ours_layer = apply_expert_parallel(copy.deepcopy(peer_layer), group=group)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(p, args.tokens, args.hidden, generator=g)  # every rank's tokens, (P, T, H)
    targets = torch.randn(p, args.tokens, args.hidden, generator=g)
    union_x, union_target = xs.reshape(-1, args.hidden), targets.reshape(-1, args.hidden)

    ours_s, peer_s = time_interleaved(
        lambda: _step(ours_layer, xs[rank], targets[rank], group),
        lambda: _step(peer_layer, union_x, union_target),
        group=group,
        iters=args.iters,
        warmup=2,
    )
    fraction = _all_to_all_fraction(ours_layer, xs[rank], targets[rank], group, args.iters)
    y_ours = _step(ours_layer, xs[rank], targets[rank], group)
    y_peer = _step(peer_layer, union_x, union_target).view(p, args.tokens, -1)[rank]
    match = torch.tensor([int(torch.allclose(y_ours, y_peer, rtol=MATCH_RTOL, atol=MATCH_ATOL))])
    ops.all_reduce(match, group, op=dist.ReduceOp.MIN)  # every rank's outputs must match
    tokens = p * args.tokens
    return comparison_record(
        f"moe E={args.experts} top{top_k} ep={p} T={args.tokens}/rank",
        ours_s,
        peer_s,
        bool(match),
        ours_tokens_per_s=tokens / ours_s,
        peer_tokens_per_s=tokens / peer_s,
        all_to_all_fraction=fraction,
        # Parameters and gradients (no optimizer in this step): ours E/P experts, the peer all E.
        ours_held_bytes=held_bytes([ours_layer]),
        peer_held_bytes=held_bytes([peer_layer]),
    )


def compare(
    *, tokens: int = 1024, hidden: int = 128, ffn: int = 256, experts: int = 8, iters: int = 10
) -> list[Record]:
    """top-1 and top-2 routing against the one-process layer on the world group (call on every rank);
    the defaults are ``main``'s."""
    args = argparse.Namespace(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, iters=iters)
    return [_case(args, top_k) for top_k in (1, 2)]


def _all_to_all_fraction(
    layer: nn.Module, x: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup, iters: int
) -> float:
    fractions = []
    for _ in range(iters):
        totals: list[float] = []
        dist.barrier()
        start = time.perf_counter()
        with timed_all_to_all(totals):
            _step(layer, x, target, group)
        fractions.append(sum(totals) / (time.perf_counter() - start))
    result = torch.tensor([statistics.median(fractions)])
    ops.all_reduce(result, group, op=dist.ReduceOp.MAX)  # report the rank that waited most
    return float(result)


def parser() -> argparse.ArgumentParser:
    """The flags of ``main``; ``polyshard bench ep`` checks them before any process starts."""
    parser = argparse.ArgumentParser(prog="polyshard bench ep", description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the records to this JSON file (rank 0)")
    parser.add_argument("--tokens", type=positive, default=1024, help="tokens per rank")
    parser.add_argument("--hidden", type=positive, default=128)
    parser.add_argument("--ffn", type=positive, default=256)
    parser.add_argument("--experts", type=positive, default=8)
    parser.add_argument("--iters", type=positive, default=10)
    one = "the one-process section (rank 0 alone): "
    parser.add_argument("--experts-rows", type=at_least(2), default=4096, help=one + "rows (the layer gets half)")
    parser.add_argument("--experts-hidden", type=positive, default=256, help=one + "hidden size")
    parser.add_argument("--experts-ffn", type=positive, default=704, help=one + "each expert's inner size")
    return parser


def _one_process(args: argparse.Namespace) -> list[Record]:
    records = ep_experts.compare(
        iters=args.iters, rows=args.experts_rows, hidden=args.experts_hidden, ffn=args.experts_ffn
    )
    ep_experts.report(records)
    return records


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)

    def report(records: list[Record]) -> None:
        write_records(records, args.json)
        for r in records:
            if "all_to_all_fraction" not in r:
                continue  # printed by ep_experts as it ran
            print(
                f"{r['case']}: ours {r['ours_tokens_per_s']:.0f} tok/s, peer {r['peer_tokens_per_s']:.0f} tok/s, "
                f"all-to-all {100 * r['all_to_all_fraction']:.1f}% of our step",
                flush=True,
            )

    if "WORLD_SIZE" not in os.environ:  # not under torchrun: the one-process section alone
        records = _one_process(args)
        write_records(records, args.json)
        return

    def measure(ctx: DistributedContext) -> list[Record]:
        records: list[Record] = []
        if ctx.rank == 0:  # one process: grouped experts vs a loop, our layer vs a torch-ops MoE
            records += _one_process(args)  # timed with group=None: no collective the others would miss
        dist.barrier()
        if ctx.world_size > 1:
            records += [_case(args, top_k) for top_k in (1, 2)]
        return records

    run_bench(measure, report)


if __name__ == "__main__":
    main()
