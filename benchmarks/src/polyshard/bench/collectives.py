"""Collective benchmark with the nccl-tests definitions of bandwidth.

For a buffer of ``size`` bytes taking ``time`` seconds:

    algbw = size / time
    busbw = algbw x 2(n-1)/n      all_reduce
    busbw = algbw x (n-1)/n       all_gather, reduce_scatter, all_to_all
    busbw = algbw                 broadcast

``size`` is the all-gather *output*, the reduce-scatter *input*, the
all-to-all buffer, and the tensor otherwise. Time is the mean over
iterations of the slowest rank.

Run it under torchrun (``polyshard bench comm --nproc 4`` does this)::

    python -m torch.distributed.run --nproc-per-node 4 -m polyshard.bench.collectives
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from polyshard.bench import timing as benchmark
from polyshard.bench.arguments import at_least, positive
from polyshard.collectives import ops
from polyshard.collectives.ledger import bus_factor

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)


def parse_size(text: str) -> int:
    """'4K' -> 4096, '1M' -> 1048576, '512' -> 512."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        amount = float(number) * scale
    except ValueError as err:
        raise ValueError(f"cannot read size {text!r}; use bytes or a K/M/G suffix, e.g. 64K") from err
    if not math.isfinite(amount):  # 'inf' and 'nan' read as floats
        raise ValueError(f"size {text!r} is not a number of bytes; use bytes or a K/M/G suffix, e.g. 64K")
    value = int(amount)
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def _make_op(op: str, size: int, n: int, device: torch.device) -> Callable[[], object]:
    """A closure running ``op`` once on a float32 buffer of ``size`` bytes (rounded to n elements)."""
    numel = max(size // 4 // n, 1) * n
    buf = torch.ones(numel, device=device)
    if op == "all_reduce":
        return lambda: ops.all_reduce(buf)
    if op == "all_gather":
        shard = buf[: numel // n].clone()
        return lambda: ops.all_gather_flat(buf, shard)
    if op == "reduce_scatter":
        out = buf[: numel // n].clone()
        return lambda: ops.reduce_scatter_flat(out, buf)
    if op == "all_to_all":
        splits = [numel // n] * n
        return lambda: ops.all_to_all(buf, splits, splits)
    if op == "broadcast":
        return lambda: ops.broadcast(buf, src=0)
    raise ValueError(f"unknown op {op!r}; choose from {OPS}")


def run_benchmark(
    op_names: Sequence[str],
    sizes: Sequence[int],
    *,
    warmup: int = 2,
    iters: int = 10,
    device: torch.device | None = None,
) -> list[benchmark.Record]:
    """Time every op at every size on the world group; every rank gets the same records."""
    n = dist.get_world_size()
    device = device or torch.device("cpu")
    records = []
    for op in op_names:
        for size in sizes:
            run = _make_op(op, size, n, device)
            for _ in range(warmup):
                run()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the time
            numel = max(size // 4 // n, 1) * n
            nbytes = numel * 4
            seconds = float(elapsed)
            algbw = nbytes / seconds / 1e9
            records.append(
                {
                    "op": op,
                    "world_size": n,
                    "bytes": nbytes,
                    "time_s": seconds,
                    "algbw_gbps": algbw,
                    "busbw_gbps": algbw * bus_factor(op, n),
                }
            )
    return records


COLUMNS = (
    ("op", 16, lambda r: r["op"]),
    ("ranks", 6, lambda r: str(r["world_size"])),
    ("bytes", 12, lambda r: str(r["bytes"])),
    ("time (us)", 12, lambda r: f"{r['time_s'] * 1e6:.1f}"),
    ("algbw GB/s", 12, lambda r: f"{r['algbw_gbps']:.3f}"),
    ("busbw GB/s", 12, lambda r: f"{r['busbw_gbps']:.3f}"),
)


def format_table(records: Sequence[benchmark.Record]) -> str:
    return benchmark.format_table(records, COLUMNS)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ", ".join(OPS))
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES), help="e.g. 4K,1M,16M")
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--iters", type=positive, default=10)
    parser.add_argument("--json", default=None, help="write the records to this file (rank 0)")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    args = parser.parse_args(argv)
    op_names = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in op_names if o not in OPS]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {list(OPS)}")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]

    benchmark.run_bench(
        lambda ctx: run_benchmark(op_names, sizes, warmup=args.warmup, iters=args.iters, device=ctx.device),
        lambda records: benchmark.write_records(records, args.json, COLUMNS),
        backend=args.backend,
    )


if __name__ == "__main__":
    main()
