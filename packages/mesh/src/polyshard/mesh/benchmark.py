"""Helpers for benchmarks that compare our implementation with a PyTorch peer.

Benchmarks are not tests: they run under torchrun (``polyshard bench ...``),
time ours and the peer *interleaved* in one process (so a noisy machine
slows both alike), and report medians and the ratio ours/peer::

    ours_s, peer_s = time_interleaved(run_ours, run_peer, iters=10, warmup=2)
    record = comparison_record("mlp tp=2", ours_s, peer_s, outputs_match=True)

Each timing ends with a barrier and takes the slowest rank's time.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def _timed(fn: Callable[[], object]) -> float:
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def time_interleaved(
    ours: Callable[[], object], peer: Callable[[], object], *, iters: int = 10, warmup: int = 2
) -> tuple[float, float]:
    """Median seconds per call of ``ours`` and ``peer``, run alternately."""
    for _ in range(warmup):
        ours()
        peer()
    ours_times, peer_times = [], []
    for i in range(iters):
        # Alternate who goes first so neither always runs on a warmer cache.
        order = [(ours, ours_times), (peer, peer_times)]
        for fn, times in order if i % 2 == 0 else reversed(order):
            times.append(_timed(fn))
    return statistics.median(ours_times), statistics.median(peer_times)


def comparison_record(case: str, ours_s: float, peer_s: float, outputs_match: bool, **extra) -> dict:
    """The record every ``polyshard bench`` writes: ratio = ours_s / peer_s."""
    return {
        "case": case,
        "ours_s": ours_s,
        "peer_s": peer_s,
        "ratio": ours_s / peer_s,
        "outputs_match": bool(outputs_match),
        **extra,
    }


def format_comparison(records: Sequence[dict]) -> str:
    lines = [f"{'case':<40}{'ours (ms)':>12}{'peer (ms)':>12}{'ratio':>8}{'match':>7}"]
    for r in records:
        lines.append(
            f"{r['case']:<40}{r['ours_s'] * 1e3:>12.2f}{r['peer_s'] * 1e3:>12.2f}{r['ratio']:>8.2f}"
            f"{'yes' if r['outputs_match'] else 'NO':>7}"
        )
    return "\n".join(lines)


def write_records(records: Sequence[dict], path: str | None) -> None:
    """Print the table and, when ``path`` is given, write the records as JSON (call on rank 0)."""
    print(format_comparison(records), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(list(records), f, indent=2)
