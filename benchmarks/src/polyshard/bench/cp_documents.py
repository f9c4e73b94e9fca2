"""Benchmark (not a test): context-parallel attention with document masks, one forward + backward of the
attention core on every rank's shard of one packed row: peak memory and seconds per rank.

    python -m torch.distributed.run --nproc-per-node 2 -m polyshard.bench.cp_documents --length 16384 --style ring

One length per launch, so each process's peak is its own. Every rank makes the whole row's q, k, v and
document ids from one seed (8 query and 8 key/value heads of 64, as ``polyshard.bench.attention_cores``'s
layer; documents of lengths uniform in [1, 2 x --document], drawn as there), keeps its two chunks
(``shard_sequence``) and runs ``context_parallel_attention(..., segments=...)`` forward and backward.
Peak: on CPU the growth of the process's peak resident memory over what it held just before the first call
(inputs made), on CUDA ``torch.cuda.max_memory_allocated`` over the same baseline; the largest of any rank.
Seconds: the slowest rank's, the median of ``--iters`` calls. Rank 0 prints one JSON record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist

from polyshard.bench.attention_cores import _segments
from polyshard.bench.peak_memory import PeakGrowth
from polyshard.collectives import ops
from polyshard.cp import Style, context_parallel_attention, shard_sequence
from polyshard.mesh import init_distributed


def measure(
    length: int, style: Style, heads: int, kv_heads: int, head_dim: int, document: int, iters: int
) -> dict[str, object]:
    cp, device = dist.get_world_size(), torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(length)
    q, k, v, grad = (torch.randn(1, h, length, head_dim, generator=g) for h in (heads, kv_heads, kv_heads, heads))
    segments = _segments(length, document, seed=length)
    q_local, k_local, v_local = (shard_sequence(t, 2, None).to(device).requires_grad_() for t in (q, k, v))
    local_grad, local_segments = shard_sequence(grad, 2, None).to(device), shard_sequence(segments, 1, None).to(device)
    del q, k, v, grad

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        out = context_parallel_attention(q_local, k_local, v_local, None, style=style, segments=local_segments)
        out.backward(local_grad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with PeakGrowth(device) as peak:
        times = [step()]
    times += [step() for _ in range(iters - 1)]
    worst = torch.tensor([float(peak.bytes), statistics.median(times)], dtype=torch.float64)
    ops.all_reduce(worst, None, op=dist.ReduceOp.MAX)
    return {
        "style": style,
        "cp": cp,
        "length": length,
        "documents": int(segments.max()) + 1,
        "peak_mib": round(float(worst[0]) / 2**20, 1),
        "seconds": round(float(worst[1]), 2),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--length", type=int, default=4096, help="tokens in the packed row (divisible by 2 cp)")
    parser.add_argument("--style", default="ring", choices=["ring", "allgather"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--document", type=int, default=1024, help="mean document length in tokens")
    parser.add_argument("--iters", type=int, default=1, help="timed calls (the first also gives the peak)")
    args = parser.parse_args(argv)
    init_distributed()
    try:
        record = measure(
            args.length, cast(Style, args.style), args.heads, args.kv_heads, args.head_dim, args.document, args.iters
        )
        if dist.get_rank() == 0:
            print(json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
