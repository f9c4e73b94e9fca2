"""Learning path 8: context parallelism - each cp rank holds 2 of the 2cp chunks of the sequence
(chunks r and 2cp-1-r, so causal work is balanced); attention then needs every earlier key and value:
ring passes K/V round the group, all-gather collects them once. Compared with SDPA on one process.

Run: python examples/08_context.py   (2 CPU processes, gloo; about 15 s)
"""

import torch
import torch.nn.functional as F

from polyshard.collectives import CommLedger
from polyshard.cp import context_parallel_attention, shard_sequence
from polyshard.mesh.pool import WorkerPool


def cp_attention(style: str) -> dict[str, object]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 16) for _ in range(3))  # (B, heads, S, D), the whole sequence
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    local = [shard_sequence(t, dim=2).requires_grad_() for t in (q, k, v)]  # this rank's 2 chunks
    with CommLedger() as ledger:
        out = context_parallel_attention(*local, style=style)
    return {
        "local sequence": local[0].shape[2],
        "bytes moved (this rank)": int(sum(e.wire_bytes for e in ledger.entries.values())),
        "max |out - SDPA|": (out - shard_sequence(reference, dim=2)).abs().max().item(),
    }


def main() -> None:
    print("sequence 64, 4 heads, head dim 16, causal; cp=2")
    pool = WorkerPool(2)
    try:
        for style in ("ring", "allgather"):
            result = pool.run(cp_attention, style)[0]
            print(
                f"{style:<10} "
                + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
            )
    finally:
        pool.close()


if __name__ == "__main__":
    main()
