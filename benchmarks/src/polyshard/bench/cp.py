"""Benchmark (not a test): ring and all-gather attention on a cp group against
``F.scaled_dot_product_attention`` on the full sequence on one process.

    torchrun --nproc-per-node 2 -m polyshard.bench.cp --seq-lens 256 512 1024 [--json cp.json]

Each timed call is one forward + backward. Ours: every rank of the group attends with its 2C local
queries (``shard_sequence``) over the whole sequence, ring or all-gather. The peer: PyTorch's SDPA
(its fused CPU/GPU kernel) over the full sequence on one process; every rank runs it, so its time
is what one process alone would take (on shared cores, a contended one). The three are timed
interleaved, each call between barriers and reported as the slowest rank's time. Records:
``case, ours_s (ring), peer_s (SDPA), ratio (ring / SDPA), outputs_match, allgather_s,
allgather_ratio, ring_max_diff, allgather_max_diff`` (the largest |difference| of any rank's output
from its shard of SDPA's).

Expect the ratios to exceed 1/cp: our block kernel is plain float32 matmul + softmax (see
:mod:`polyshard.cp.blocks`), not a fused kernel, and the group pays for its communication.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.bench.timing import Column, Record, comparison_record, run_bench, write_records
from polyshard.collectives import ops
from polyshard.cp.attention import Style, context_parallel_attention
from polyshard.cp.sharding import shard_sequence

# float32 throughout; sums over up to a few thousand keys taken in another order (per block and
# merged, against SDPA's kernel): 1e-4 is looser than the tests' 1e-5, which sum over 24 keys.
MATCH_ATOL = 1e-4

COLUMNS: tuple[Column, ...] = (
    ("case", 44, lambda r: r["case"]),
    ("ring (ms)", 11, lambda r: f"{r['ours_s'] * 1e3:.2f}"),
    ("allgather (ms)", 16, lambda r: f"{r['allgather_s'] * 1e3:.2f}"),
    ("sdpa (ms)", 11, lambda r: f"{r['peer_s'] * 1e3:.2f}"),
    ("ring/sdpa", 11, lambda r: f"{r['ratio']:.2f}"),
    ("ag/sdpa", 9, lambda r: f"{r['allgather_ratio']:.2f}"),
    ("max diff", 10, lambda r: f"{max(r['ring_max_diff'], r['allgather_max_diff']):.1e}"),
)


def _timed(fn: Callable[[], object], group: dist.ProcessGroup | None) -> float:
    """Seconds of one call between barriers, the slowest rank's."""
    dist.barrier(group)
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier(group)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    ops.all_reduce(elapsed, group, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _time_interleaved(fns: Sequence[Callable[[], object]], group: dist.ProcessGroup | None, iters: int) -> list[float]:
    """Median seconds per call of each of ``fns``, run in turn, the order rotating every round."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(iters):
        for j in range(len(fns)):
            index = (i + j) % len(fns)
            times[index].append(_timed(fns[index], group))
    return [statistics.median(t) for t in times]


def _case(
    seq_len: int,
    group: dist.ProcessGroup | None,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    causal: bool,
    iters: int,
    device: torch.device,
) -> Record:
    cp = dist.get_world_size(group)
    g = torch.Generator().manual_seed(seq_len)
    q, grad_out = (torch.randn(batch, heads, seq_len, head_dim, generator=g).to(device) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, generator=g).to(device) for _ in range(2))
    q_local, k_local, v_local = (shard_sequence(t, 2, group).requires_grad_() for t in (q, k, v))
    local_grad = shard_sequence(grad_out, 2, group)
    q_full, k_full, v_full = (t.clone().requires_grad_() for t in (q, k, v))

    def ours(style: Style) -> torch.Tensor:
        out = context_parallel_attention(q_local, k_local, v_local, group, causal=causal, style=style)
        out.backward(local_grad)
        return out.detach()

    def peer() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=causal, enable_gqa=True)
        out.backward(grad_out)
        return out.detach()

    candidates = [lambda: ours("ring"), lambda: ours("allgather"), peer]
    ring_s, allgather_s, peer_s = _time_interleaved(candidates, group, iters)
    expected = shard_sequence(peer(), 2, group)
    diffs = torch.tensor([(ours(style) - expected).abs().max().item() for style in ("ring", "allgather")])
    ops.all_reduce(diffs, group, op=dist.ReduceOp.MAX)
    ring_diff, allgather_diff = diffs.tolist()
    return comparison_record(
        f"{'causal' if causal else 'full'} S={seq_len} cp={cp} B={batch} N={heads}/{kv_heads} D={head_dim}",
        ring_s,
        peer_s,
        max(ring_diff, allgather_diff) <= MATCH_ATOL,
        allgather_s=allgather_s,
        allgather_ratio=allgather_s / peer_s,
        ring_max_diff=ring_diff,
        allgather_max_diff=allgather_diff,
    )


def compare(
    seq_lens: Sequence[int] = (256, 512, 1024),
    group: dist.ProcessGroup | None = None,
    *,
    batch: int = 1,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int = 64,
    causal: bool = True,
    iters: int = 5,
    device: torch.device | str = "cpu",
) -> list[Record]:
    """Time ring, all-gather and one-process SDPA (forward + backward) at each sequence length; run
    it on every rank of ``group`` (None: the world; a group of one process works too). Each
    length must be divisible by 2 * cp."""
    return [
        _case(
            seq_len,
            group,
            batch=batch,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            causal=causal,
            iters=iters,
            device=torch.device(device),
        )
        for seq_len in seq_lens
    ]


def parser() -> argparse.ArgumentParser:
    """The flags of ``main``; ``polyshard bench cp`` checks them before any process starts."""
    parser = argparse.ArgumentParser(prog="polyshard bench cp", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024], help="global sequence lengths")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--full", action="store_true", help="non-causal attention")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the records to this JSON file (rank 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run_bench(
        lambda ctx: compare(
            args.seq_lens,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            causal=not args.full,
            iters=args.iters,
            device=ctx.device,
        ),
        lambda records: write_records(records, args.json, COLUMNS),
    )


if __name__ == "__main__":
    main()
