"""Helpers for benchmarks that compare our implementation with a PyTorch peer.

Benchmarks are not tests: they run under torchrun (``polyshard bench ...``),
time ours and the peer *interleaved* in one process (so a noisy machine
slows both alike), and report medians and the ratio ours/peer::

    ours_s, peer_s = time_interleaved(run_ours, run_peer, group=dist.group.WORLD, iters=10, warmup=2)
    record = comparison_record("mlp tp=2", ours_s, peer_s, outputs_match=True)

``group`` names the processes that run the timed code together: each timing starts and ends with
a barrier on it and takes its slowest rank's time. ``group=None`` times on this process alone and
issues no collective, so a comparison that one rank runs by itself never leaves the others waiting
in a barrier it will not reach (or, worse, pairs its barrier with their next collective).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from polyshard.mesh.init import DistributedContext, init_distributed

Record = dict[str, Any]
"""One benchmark result, a JSON object: a case name, timings, and whatever the benchmark adds."""


def _timed(fn: Callable[[], object], group: dist.ProcessGroup | None) -> float:
    if group is not None:
        dist.barrier(group)
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if group is not None:
        if dist.get_backend(group) == "nccl":  # NCCL reduces CUDA tensors only
            elapsed = elapsed.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def time_interleaved(
    ours: Callable[[], object],
    peer: Callable[[], object],
    *,
    group: dist.ProcessGroup | None,
    iters: int = 10,
    warmup: int = 2,
) -> tuple[float, float]:
    """Median seconds per call of ``ours`` and ``peer``, run alternately, each call the slowest time
    over ``group`` (every rank of it must call this too), or this process's own with ``group=None``.
    ``group`` has no default: every caller says who runs the code with it."""
    for _ in range(warmup):
        ours()
        peer()
    ours_times: list[float] = []
    peer_times: list[float] = []
    for i in range(iters):
        # Alternate who goes first so neither always runs on a warmer cache.
        order = [(ours, ours_times), (peer, peer_times)]
        for fn, times in order if i % 2 == 0 else reversed(order):
            times.append(_timed(fn, group))
    return statistics.median(ours_times), statistics.median(peer_times)


def comparison_record(case: str, ours_s: float, peer_s: float, outputs_match: bool, **extra: object) -> Record:
    """The record every ``polyshard bench`` writes: ratio = ours_s / peer_s."""
    return {
        "case": case,
        "ours_s": ours_s,
        "peer_s": peer_s,
        "ratio": ours_s / peer_s,
        "outputs_match": bool(outputs_match),
        **extra,
    }


def held_bytes(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer] = ()) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds for ``modules``: the distinct
    storages behind their local tensors (a DTensor's local shard), so a view (a gradient inside a
    bucket) counts once and a freed storage counts zero. For a PyTorch peer; polyshard.dp's wrappers
    report their own with ``polyshard.dp.bytes_held``."""

    def local(t: torch.Tensor) -> torch.Tensor:
        to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard
        return to_local() if callable(to_local) else t

    tensors: list[torch.Tensor] = []
    for module in modules:
        for p in module.parameters():
            tensors.append(local(p))
            if p.grad is not None:
                tensors.append(local(p.grad))
    for optimizer in optimizers:
        for state in optimizer.state.values():
            tensors += [local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


Column = tuple[str, int, Callable[[Record], str]]
"""(header, width, cell text from a record); the first column is left-aligned, the rest right."""

COMPARISON_COLUMNS: tuple[Column, ...] = (
    ("case", 40, lambda r: r["case"]),
    ("ours (ms)", 12, lambda r: f"{r['ours_s'] * 1e3:.2f}"),
    ("peer (ms)", 12, lambda r: f"{r['peer_s'] * 1e3:.2f}"),
    ("ratio", 8, lambda r: f"{r['ratio']:.2f}"),
    ("match", 7, lambda r: "yes" if r["outputs_match"] else "NO"),
)


def format_table(records: Sequence[Record], columns: Sequence[Column] = COMPARISON_COLUMNS) -> str:
    """One header line and one line per record."""

    def line(cells: Sequence[str]) -> str:
        first, *rest = zip(cells, (width for _, width, _ in columns))
        return f"{first[0]:<{first[1]}}" + "".join(f"{cell:>{width}}" for cell, width in rest)

    return "\n".join([line([h for h, _, _ in columns])] + [line([cell(r) for _, _, cell in columns]) for r in records])


def write_records(records: Sequence[Record], path: str | None, columns: Sequence[Column] = COMPARISON_COLUMNS) -> None:
    """Print the table and, when ``path`` is given, write the records as JSON (call on rank 0)."""
    print(format_table(records, columns), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(list(records), f, indent=2)


def run_bench(
    measure: Callable[[DistributedContext], list[Record]],
    report: Callable[[list[Record]], None],
    *,
    backend: str | None = None,
) -> None:
    """How every ``polyshard bench`` command runs: start the process group, ``measure`` on every rank,
    ``report`` on rank 0, wait for it, and tear the group down. Models and groups should live inside
    ``measure``, so they are freed before the group is destroyed (gloo can abort at exit when a
    process group outlives destroy_process_group)."""
    ctx = init_distributed(backend=backend)
    try:
        records = measure(ctx)
        if ctx.rank == 0:
            report(records)
        dist.barrier()  # rank 0 prints and writes: let it finish before any rank tears its group down
    finally:
        dist.destroy_process_group()
