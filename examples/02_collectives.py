"""Learning path 2: collectives, what each sends, and a cost model fitted to measured times.

Each rank of a ring all-reduce sends 2(n-1)/n of the buffer; all-gather and reduce-scatter (n-1)/n. The
"bus bandwidth" (nccl-tests) divides those bytes by the time, so one figure describes every collective.
The ledger counts the bytes; the planner's calibration fits time = latency + bytes x factor / busbw.

Run: python examples/02_collectives.py   (2 CPU processes, gloo; about 15 s)
"""

import statistics
import time

import torch
import torch.distributed as dist

from polyshard.collectives import CommLedger, ops
from polyshard.collectives.ledger import bus_factor
from polyshard.mesh.pool import WorkerPool
from polyshard.planner.calibrate import fit_link

SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)  # bytes of float32 per rank


def ledger_bytes(nbytes: int) -> dict[str, tuple[int, float]]:
    """One call of each collective under a ledger: (size, bytes this rank sends) as the ledger counts them."""
    n = dist.get_world_size()
    x = torch.ones(nbytes // 4)
    out = {}
    for op, call in (
        ("all_reduce", lambda: ops.all_reduce(x.clone())),
        ("all_gather", lambda: ops.all_gather(x[: x.numel() // n])),
        ("reduce_scatter", lambda: ops.reduce_scatter(x.clone())),
    ):
        with CommLedger() as ledger:
            call()
        out[op] = (ledger.total(op), ledger.wire(op))
    return out


def time_all_reduce(nbytes: int, repeats: int = 7) -> float:
    """Median seconds of one all-reduce (the slowest rank's)."""
    x = torch.ones(nbytes // 4)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    median = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def main() -> None:
    n = 2
    pool = WorkerPool(n)
    try:
        print(f"what one rank sends, n={n} (ring algorithm), 1 MiB buffer:")
        for op, (size, wire) in pool.run(ledger_bytes, 1 << 20)[0].items():
            print(f"  {op:<15} size {size:>8} B  sends {wire:>9.0f} B  = {wire / size:.2f} x size")
        print(f"bus factor all_reduce {bus_factor('all_reduce', n):.2f}, all_gather {bus_factor('all_gather', n):.2f}")
        seconds = [pool.run(time_all_reduce, s)[0] for s in SIZES]
    finally:
        pool.close()
    # The planner's own fit (polyshard plan --calibrate): time = latency + bytes x factor / busbw.
    link = fit_link([(size * bus_factor("all_reduce", n), t) for size, t in zip(SIZES, seconds)])
    for size, t in zip(SIZES, seconds):
        busbw = size * bus_factor("all_reduce", n) / t / 1e9
        model = link.latency_s + size * bus_factor("all_reduce", n) / (link.busbw_gbps * 1e9)
        print(
            f"measured: all_reduce {size:>8} B  {t * 1e3:8.3f} ms  busbw {busbw:6.3f} GB/s  model {model * 1e3:8.3f} ms"
        )
    print(f"measured: fitted latency {link.latency_s * 1e6:.0f} us, bus bandwidth {link.busbw_gbps:.3f} GB/s")


if __name__ == "__main__":
    main()
