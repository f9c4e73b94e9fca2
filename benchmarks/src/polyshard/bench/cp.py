"""Benchmark (not a test): ring, all-gather, Ulysses and (on 4+ ranks, where the heads allow) Ulysses x
ring attention on a cp group against ``F.scaled_dot_product_attention`` on the full sequence on one process.

    torchrun --nproc-per-node 2 -m polyshard.bench.cp --seq-lens 256 512 1024 [--json cp.json]

Each timed call is one forward + backward. Ours: every rank of the group attends with its 2C local
queries (``shard_sequence``) over the whole sequence, ring or all-gather. The peer: PyTorch's SDPA
(its fused CPU/GPU kernel) over the full sequence on one process; every rank runs it, so its time
is what one process alone would take (on shared cores, a contended one). The three are timed
interleaved, each call between barriers and reported as the slowest rank's time. Records:
``case, ours_s (ring), peer_s (SDPA), ratio (ring / SDPA), outputs_match``, and per style (ring,
allgather, ulysses, ulysses+ring): ``<style>_s``, ``<style>_ratio``, ``<style>_max_diff`` (the largest
|difference| of any rank's output from its shard of SDPA's), ``<style>_bytes`` (wire bytes one rank sent
in a forward + backward, from the byte ledger, the most of any rank), ``<style>_formula`` (the same from
the formulas of :func:`expected_bytes`) and ``<style>_peak`` (peak device memory of the call on CUDA,
bytes; None on CPU). The 2-D scheme all-to-alls over the largest group the heads allow below cp.

Expect the ratios to exceed 1/cp: the group pays for its communication, the ranks share the machine's
cores, and on a GPU our blocks run the plain float32 kernel (:mod:`polyshard.cp.blocks`; on a CPU an
unmasked block runs ATen's fused one).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.bench.arguments import positive
from polyshard.bench.timing import Column, Record, comparison_record, run_bench, write_records
from polyshard.collectives import CommLedger, ops
from polyshard.cp.attention import Style, context_parallel_attention
from polyshard.cp.groups import ulysses_ring_groups
from polyshard.cp.sharding import shard_sequence

# float32 throughout; sums over up to a few thousand keys taken in another order (per block and
# merged, against SDPA's kernel): 1e-4 is looser than the tests' 1e-5, which sum over 24 keys.
MATCH_ATOL = 1e-4

SHORT = {"ring": "ring", "allgather": "ag", "ulysses": "uly", "ulysses+ring": "2d"}
"""Column names of each style (2d: Ulysses x ring)."""
COLUMNS: tuple[Column, ...] = (
    ("case", 44, lambda r: r["case"]),
    ("sdpa (ms)", 11, lambda r: f"{r['peer_s'] * 1e3:.2f}"),
    *(
        (f"{short}/sdpa", 11, lambda r, s=style: f"{r[s + '_ratio']:.2f}" if s + "_ratio" in r else "-")
        for style, short in SHORT.items()
    ),
    *(
        (f"{short} MB", 10, lambda r, s=style: f"{r[s + '_bytes'] / 1e6:.3f}" if s + "_bytes" in r else "-")
        for style, short in SHORT.items()
    ),
    ("bytes=formula", 15, lambda r: str(r["bytes_match"])),
    ("max diff", 10, lambda r: f"{r['max_diff']:.1e}"),
)


def expected_bytes(style: str, cp: int, q: int, kv: int, kv_heads: int, element: int, ulysses: int = 0) -> float:
    """Wire bytes one rank sends for one forward + backward; ``q`` and ``kv``: the elements of its Q (= its
    output) and of its K (= V), ``element`` the inputs' bytes per element (gradients of K/V travel in
    float32 where the style says so). ring: (cp-1) K/V hops forward, (cp-1) again and cp float32 dK/dV
    hops backward; allgather: K and V gathered, their float32 gradients reduce-scattered, (cp-1)/cp of
    each; ulysses: Q, K, V and the output all-to-all'd each way, (cp-1)/cp of each, K/V repeated for ranks
    beyond the kv heads; ulysses+ring: that over ``ulysses`` ranks, then the ring over cp / ulysses on
    the repeated K/V."""
    if style == "ring":
        return 2 * (cp - 1) * 2 * kv * element + cp * 2 * kv * 4
    if style == "allgather":
        return 2 * (cp - 1) * kv * (element + 4)
    group = cp if style == "ulysses" else ulysses
    kv *= max(1, group // kv_heads)
    moved = 2 * (group - 1) / group * (2 * q + 2 * kv) * element
    if style == "ulysses":
        return moved
    return moved + expected_bytes("ring", cp // group, q, kv, kv_heads, element)


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


def _ulysses_size(cp: int, heads: int, kv_heads: int) -> int:
    """The 2-D scheme's all-to-all group: the largest divisor of cp below it that splits the heads; 0: none."""
    fits = [u for u in range(2, cp) if cp % u == 0 and heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0)]
    return fits[-1] if fits else 0


def _measured(fn: Callable[[], object], group: dist.ProcessGroup | None) -> tuple[float, float | None]:
    """(wire bytes this call sent from the rank that sent the most, its peak CUDA memory or None on CPU)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with CommLedger() as ledger:
        fn()
    stats = torch.tensor([ledger.wire(), torch.cuda.max_memory_allocated() if cuda else 0.0], dtype=torch.float64)
    ops.all_reduce(stats, group, op=dist.ReduceOp.MAX)
    return float(stats[0]), float(stats[1]) if cuda else None


def _case(
    seq_len: int,
    group: dist.ProcessGroup | None,
    two_d: tuple[int, dist.ProcessGroup, dist.ProcessGroup] | None,
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
        groups = (two_d[1], two_d[2]) if style == "ulysses+ring" and two_d else (group, None)
        out = context_parallel_attention(
            q_local, k_local, v_local, groups[0], causal=causal, style=style, ring_group=groups[1]
        )
        out.backward(local_grad)
        return out.detach()

    def peer() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=causal, enable_gqa=True)
        out.backward(grad_out)
        return out.detach()

    styles: list[Style] = ["ring", "allgather"]
    styles += ["ulysses"] if heads % cp == 0 and (kv_heads % cp == 0 or cp % kv_heads == 0) else []
    styles += ["ulysses+ring"] if two_d else []
    times = _time_interleaved([*(functools.partial(ours, s) for s in styles), peer], group, iters)
    peer_s = times[-1]
    expected = shard_sequence(peer(), 2, group)
    extra: dict[str, object] = {}
    counted, worst = True, 0.0
    for style, seconds in zip(styles, times):
        diff = torch.tensor([(ours(style) - expected).abs().max().item()])
        ops.all_reduce(diff, group, op=dist.ReduceOp.MAX)
        sent, peak = _measured(functools.partial(ours, style), group)
        formula = expected_bytes(
            style, cp, q_local.numel(), k_local.numel(), kv_heads, q.element_size(), two_d[0] if two_d else 0
        )
        counted &= abs(sent - formula) <= 1e-9 * formula
        worst = max(worst, float(diff))
        extra |= {f"{style}_s": seconds, f"{style}_ratio": seconds / peer_s, f"{style}_max_diff": float(diff)}
        extra |= {f"{style}_bytes": sent, f"{style}_formula": formula, f"{style}_peak": peak}
    two = f" u={two_d[0]}" if two_d else ""
    return comparison_record(
        f"{'causal' if causal else 'full'} S={seq_len} cp={cp}{two} B={batch} N={heads}/{kv_heads} D={head_dim}",
        times[0],
        peer_s,
        worst <= MATCH_ATOL,
        **extra,
        bytes_match=counted,
        max_diff=worst,
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
    cp = dist.get_world_size(group)
    ulysses = _ulysses_size(cp, heads, kv_heads)
    two_d = None
    if ulysses and group is None:  # collective: every rank creates both groups of the world's 2-D split
        two_d = (ulysses, *ulysses_ring_groups([list(range(cp))], ulysses))
    return [
        _case(
            seq_len,
            group,
            two_d,
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
    parser.add_argument(
        "--seq-lens", type=positive, nargs="+", default=[256, 512, 1024], help="global sequence lengths"
    )
    parser.add_argument("--heads", type=positive, default=8)
    parser.add_argument("--kv-heads", type=positive, default=4)
    parser.add_argument("--head-dim", type=positive, default=64)
    parser.add_argument("--full", action="store_true", help="non-causal attention")
    parser.add_argument("--iters", type=positive, default=5)
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
