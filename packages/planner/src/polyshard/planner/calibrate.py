"""``polyshard plan --calibrate``: measure this machine and write a :class:`Profile`.

Workers are spawned with :class:`polyshard.mesh.pool.WorkerPool` (one intra-op thread each, as
torchrun gives every process; gloo on CPUs). It measures, per process:

* with 1, 2 and 4 processes computing at once (on a CPU they share the cores): the TFLOP/s of a
  block's linear layer on 1024 tokens at widths h (its forward, input-gradient and weight-gradient
  products); a real transformer block's forward and backward
  at widths 64 and 256 on two batch sizes, minus its matmuls' time at that rate, as a fixed cost per
  block plus a rate per byte it saves for backward; an AdamW step over one large and over many small
  tensors (its streaming bandwidth and its cost per tensor);
* all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point on groups of 2 and 4 (and
  groups of 2 while 4 processes run), at five sizes, fitted to ``latency + bytes x bus factor /
  bus bandwidth`` (least squares).

Each figure is the slowest rank's median. The machine may be shared: the profile records the load
it was measured under, which the predictions then assume.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.collectives.ledger import bus_factor
from polyshard.planner.profile import OPS, Link, Profile, interpolate

PROCESSES = (1, 2, 4)


@dataclass(frozen=True)
class Sweep:
    """What to measure: widths of the matmuls and the block probes, collective sizes, rounds."""

    widths: tuple[int, ...] = (64, 256, 1024)
    probe_widths: tuple[int, ...] = (64, 256)
    sizes: tuple[int, ...] = (4 << 10, 256 << 10, 1 << 20, 4 << 20)
    rounds: int = 3
    """The compute figures are medians over rounds (a shared machine's load comes and goes)."""
    budget_s: float = 0.15
    """Seconds of repetitions per measurement."""


FULL = Sweep()
QUICK = Sweep(widths=(64, 256), probe_widths=(64,), sizes=(4 << 10, 256 << 10), rounds=1, budget_s=0.03)


def _repeat(fn: Callable[[], object], budget_s: float, sync: bool = False) -> float:
    """Median seconds per call over about ``budget_s`` (after one warm-up); with ``sync`` every rank
    runs the same number of calls and the slowest rank's time is returned."""
    fn()
    start, times = time.perf_counter(), []
    while True:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        more = torch.tensor([float(time.perf_counter() - start < budget_s or len(times) < 3)])
        if sync:  # go on only while every rank would, so all run the same number of calls
            dist.all_reduce(more, op=dist.ReduceOp.MIN)
        if not more.item():
            break
    seconds = torch.tensor([statistics.median(times)], dtype=torch.float64)
    if sync:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def _matmul(widths: Sequence[int], budget_s: float) -> dict[int, float]:
    """TFLOP/s of the three products a linear layer of a block runs on 1024 tokens: forward
    (1024 x h) @ (h x 4h), input gradient (1024 x 4h) @ (4h x h), weight gradient (h x 1024) @ (1024 x 4h)."""
    rates = {}
    for h in widths:
        x, w, g = torch.randn(1024, h), torch.randn(h, 4 * h), torch.randn(1024, 4 * h)
        seconds = _repeat(functools.partial(_linear_products, x, w, g), budget_s)
        rates[h] = 3 * 2 * 1024 * h * 4 * h / seconds / 1e12
    return rates


def _linear_products(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A linear layer's forward ``x @ w``, input gradient ``g @ w.T`` and weight gradient ``x.T @ g``."""
    return x @ w, g @ w.t(), x.t() @ g


def _forward_backward(block: torch.nn.Module, x: torch.Tensor) -> None:
    block(x).sum().backward()


def _elementwise(h: int, saved_per_token: float, matmul_tflops: float, budget_s: float) -> tuple[float, float]:
    """(GB/s of saved bytes, fixed seconds) of a GPT block of width h beyond its matmuls, from its forward
    and backward on 4 and on 16 sequences of 64 tokens: the line through the two."""
    from polyshard.models.common import Block

    seq, block = 64, Block(h, h // 16)
    points = []
    for batch in (4, 16):
        x = torch.randn(batch, seq, h, requires_grad=True)
        seconds = _repeat(functools.partial(_forward_backward, block, x), budget_s)
        tokens = batch * seq
        flops = 3 * 2 * tokens * 12 * h * h + 3 * 2 * tokens * seq * h  # matmuls, attention: F + B + W
        points.append((saved_per_token * tokens, max(seconds - flops / (matmul_tflops * 1e12), 0.05 * seconds)))
    link = fit_link(points)
    return link.busbw_gbps, link.latency_s


def probe_saved_bytes(widths: Sequence[int]) -> dict[int, float]:
    """Bytes per token the probe block saves for backward, as :mod:`activations` counts them (worked
    out here in the parent: the workers need not import the trainer)."""
    from polyshard.models.gpt.config import GPTConfig
    from polyshard.planner.activations import block_bytes_per_token
    from polyshard.trainer.config import ParallelConfig

    one_process = ParallelConfig()
    return {
        h: block_bytes_per_token(GPTConfig(hidden=h, num_heads=h // 16, context_length=64), one_process, "fp32")
        for h in widths
    }


def _optimizer(budget_s: float) -> tuple[float, float]:
    """(GB/s streamed, seconds per tensor) of AdamW: one tensor of 2^20 elements, then 256 of 2^12."""
    times = []
    for count in (1, 256):
        params = [torch.nn.Parameter(torch.randn((1 << 20) // count)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        times.append(_repeat(torch.optim.AdamW(params).step, budget_s))
    per_tensor = max((times[1] - times[0]) / 255, 0.0)
    return 28 * (1 << 20) / max(times[0] - per_tensor, 1e-9) / 1e9, per_tensor


class _Round(TypedDict):
    """One round of :func:`_compute`'s measurements on one process."""

    matmul: dict[int, float]
    """TFLOP/s by width."""
    probe: dict[int, tuple[float, float]]
    """(GB/s of saved bytes, seconds per block) by width."""
    optimizer: tuple[float, float]
    """(GB/s streamed, seconds per tensor) of AdamW."""


def _compute(sweep: Sweep, saved: dict[int, float]) -> dict[str, Any]:
    """This process's figures while every process of the pool measures the same at once."""
    rounds: list[_Round] = []
    for _ in range(sweep.rounds):
        dist.barrier()
        matmul = _matmul(sweep.widths, sweep.budget_s)
        probe = {h: _elementwise(h, saved[h], interpolate(matmul, h), sweep.budget_s) for h in sweep.probe_widths}
        rounds.append({"matmul": matmul, "probe": probe, "optimizer": _optimizer(sweep.budget_s)})
    dist.barrier()
    return {
        "matmul": {h: statistics.median(r["matmul"][h] for r in rounds) for h in sweep.widths},
        "elementwise": {h: statistics.median(r["probe"][h][0] for r in rounds) for h in sweep.probe_widths},
        "overhead": {h: statistics.median(r["probe"][h][1] for r in rounds) for h in sweep.probe_widths},
        "memory": statistics.median(r["optimizer"][0] for r in rounds),
        "per_tensor": statistics.median(r["optimizer"][1] for r in rounds),
    }


def _one_call(op: str, nbytes: int, group: dist.ProcessGroup | None) -> Callable[[], object]:
    n = dist.get_world_size(group)
    numel = max(nbytes // 4 // n, 1) * n
    buf = torch.ones(numel)
    shard = buf[: numel // n].clone()
    if op == "all_reduce":
        return lambda: ops.all_reduce(buf, group)
    if op == "all_gather":
        return lambda: ops.all_gather_flat(buf, shard, group)
    if op == "reduce_scatter":
        return lambda: ops.reduce_scatter_flat(shard, buf, group)
    if op == "all_to_all":
        return lambda: ops.all_to_all(buf, [numel // n] * n, [numel // n] * n, group)
    rank = dist.get_rank()
    peer = rank ^ 1  # pairs (0, 1), (2, 3): one send and one receive each way; a call is one transfer

    def ping_pong() -> None:
        for sender in (rank & ~1, rank | 1):
            dist.send(buf, peer) if rank == sender else dist.recv(buf, peer)

    return ping_pong


def _collectives(sweep: Sweep, group_size: int) -> dict[str, list[tuple[int, float]]]:
    """Per op, (bytes, seconds per call) on groups of ``group_size`` consecutive ranks, all running at
    once (point-to-point: pairs, one transfer per call)."""
    world = dist.get_world_size()
    groups = [dist.new_group(list(range(g, g + group_size))) for g in range(0, world, group_size)]
    mine = groups[dist.get_rank() // group_size] if group_size < world else None
    out: dict[str, list[tuple[int, float]]] = {}
    for op in OPS:
        for nbytes in sweep.sizes:
            seconds = _repeat(_one_call(op, nbytes, mine), sweep.budget_s, sync=True)
            out.setdefault(op, []).append((nbytes, seconds / 2 if op == "p2p" else seconds))
    return out


def fit_link(points: Sequence[tuple[float, float]]) -> Link:
    """Least-squares ``seconds = latency + wire_bytes / bandwidth`` over (wire bytes, seconds) points;
    the latency is kept >= 0 and the bandwidth > 0."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    latency = my - slope * mx
    if latency < 0:  # a line through the origin instead
        latency, slope = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    slope = max(slope, 1e-15)
    return Link(latency_s=latency, busbw_gbps=1.0 / slope / 1e9)


Rounds = list[dict[str, Any]]
"""Raw measurements, one entry per round: {"compute": {k: per-rank results}, "collectives": {(k, n): times}}."""


def measure_round(pools: Mapping[int, Any], sweep: Sweep, saved: Mapping[int, float]) -> dict[str, Any]:
    """One round of every measurement on live worker pools (processes -> pool)."""
    out: dict[str, Any] = {"compute": {}, "collectives": {}}
    for k, pool in sorted(pools.items()):
        out["compute"][k] = pool.run(_compute, sweep, dict(saved), timeout_s=600)
        for n in sorted({k, 2} if k > 1 else set()):
            out["collectives"][(k, n)] = pool.run(_collectives, sweep, n, timeout_s=600)[0]
    return out


def to_profile(rounds: Rounds, log: Callable[[str], None] = print) -> Profile:
    """The profile of measured rounds: every figure the median over ranks and rounds; each collective's
    line fitted through its per-size medians."""
    matmul, elementwise, overhead, memory, per_tensor = {}, {}, {}, {}, {}
    for k in rounds[0]["compute"]:
        results = [r for round_ in rounds for r in round_["compute"][k]]
        matmul[k] = {h: statistics.median(r["matmul"][h] for r in results) for h in results[0]["matmul"]}
        elementwise[k] = {h: statistics.median(r["elementwise"][h] for r in results) for h in results[0]["elementwise"]}
        overhead[k] = {h: statistics.median(r["overhead"][h] for r in results) for h in results[0]["overhead"]}
        memory[k] = statistics.median(r["memory"] for r in results)
        per_tensor[k] = statistics.median(r["per_tensor"] for r in results)
        fixed_ms = {h: v * 1e3 for h, v in overhead[k].items()}
        log(
            f"{k} process(es) at once, each: matmul TFLOP/s {_describe(matmul[k])}; elementwise GB/s "
            f"{_describe(elementwise[k])} + ms per block {_describe(fixed_ms)}; "
            f"AdamW {memory[k]:.2f} GB/s + {per_tensor[k] * 1e6:.0f} us per tensor"
        )
    collectives: dict[int, dict[str, dict[str, dict[int, Link]]]] = {}
    for (k, n), first in rounds[0]["collectives"].items():
        for op, points in first.items():
            sizes = [nbytes for nbytes, _ in points]
            medians = [statistics.median(r["collectives"][(k, n)][op][i][1] for r in rounds) for i in range(len(sizes))]
            factor = bus_factor(op, n) if op != "p2p" else 1.0
            link = fit_link([(nbytes * factor, seconds) for nbytes, seconds in zip(sizes, medians)])
            collectives.setdefault(k, {}).setdefault(op, {"intra": {}})["intra"][n] = link
            log(
                f"  {op:<15} group of {n} ({k} running): {link.latency_s * 1e6:8.1f} us + bytes / "
                f"{link.busbw_gbps:.3f} GB/s"
            )
    collectives.setdefault(1, collectives[min(collectives)])  # one process alone never communicates
    host = platform.node() or "this machine"
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return Profile(
        name=f"measured-{host}",
        source=f"measured on {host} at {when} (median of {len(rounds)} rounds, load average {load:.1f}, "
        f"{os.cpu_count()} cores)",
        matmul_tflops=matmul,
        elementwise_gbps=elementwise,
        block_overhead_s=overhead,
        memory_gbps=memory,
        optimizer_tensor_s=per_tensor,
        collectives=collectives,
        memory_gb=_memory_gb() / max(matmul),
        devices_per_node=max(matmul),
        overlap=0.0,  # gloo's threads share the cores with compute: nothing is hidden
        notes=[f"one intra-op thread per process; torch {torch.__version__}; gloo"],
    )


def calibrate(processes: Sequence[int] = PROCESSES, sweep: Sweep = FULL, log: Callable[[str], None] = print) -> Profile:
    """Measure this machine and return its profile (FULL: a few minutes on a loaded 2-core machine;
    QUICK: one short round at fewer sizes, for a first look)."""
    from polyshard.mesh.pool import WorkerPool

    pools = {k: WorkerPool(k) for k in processes}
    try:
        return to_profile([measure_round(pools, sweep, probe_saved_bytes(sweep.probe_widths))], log)
    finally:
        for pool in pools.values():
            pool.close()


def _describe(table: dict[int, float]) -> str:
    return ", ".join(f"h{h} {value:.3f}" for h, value in table.items())


def _memory_gb() -> float:
    """Physical memory of this machine, GB."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 0.0
