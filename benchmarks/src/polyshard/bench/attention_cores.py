"""Peak memory and time of one attention layer, forward and backward, with document masks: the dense
boolean mask (the old path), the block-sparse core, and plain causal SDPA without documents (the floor).

    python -m polyshard.bench.attention_cores --lengths 4096 16384 32768

Each (variant, length) runs in a fresh process, so its peak is its own: on CPU the growth of the
process's peak resident memory over what it held just before the layer ran (inputs and weights made),
on CUDA ``torch.cuda.max_memory_allocated`` over the same baseline. The rows' documents are drawn once
per length from a fixed seed (lengths uniform in [1, 2 x --document]); the block-sparse core's plan says
which fraction of its key/value blocks it skips. The goal (issue 35): at 32K the masked layer needs at
most 1.2 x the memory of the unmasked causal layer, and its time falls with the fraction skipped.
Standalone: it needs torch and polyshard-models only. Time it on an idle machine: on a loaded one the
block-sparse core's many small per-block operations suffer most from CPU threads waiting on each other
(a 256 x 256 logsumexp took 30 ms on 2 threads and 1 ms on 1 under a load of 12).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

VARIANTS = ("causal-sdpa", "dense-mask", "blocksparse")


def _segments(length: int, document: int, seed: int):  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(seed)
    sizes: list[int] = []
    while sum(sizes) < length:
        sizes.append(int(torch.randint(1, 2 * document + 1, (1,), generator=g)))
    sizes[-1] -= sum(sizes) - length
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[None]  # (1, S)


def run_one(variant: str, length: int, args: argparse.Namespace) -> dict[str, object]:
    """One forward + backward of one layer in this process: peak memory growth and seconds."""
    import torch
    import torch.nn.functional as F

    from polyshard.bench.peak_memory import PeakGrowth
    from polyshard.models.common import Attention, Documents, RopeConfig, document_mask, document_positions
    from polyshard.models.common.cores import BLOCK, Visibility, plan_sparse_blocks

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    core = "blocksparse" if variant == "blocksparse" else "auto"
    layer = Attention(args.hidden, args.heads, args.kv_heads, bias=False, rope=RopeConfig(), core=core).to(device)
    x = torch.randn(1, length, args.hidden, device=device, requires_grad=True)
    segments = _segments(length, args.document, seed=length).to(device)
    documents = None if variant == "causal-sdpa" else Documents(segments, document_positions(segments))
    if variant == "dense-mask":  # the path this replaces: SDPA with a (B, 1, S, S) boolean mask

        def dense(q, k, v, segments=None):  # type: ignore[no-untyped-def]
            mask = document_mask(segments, segments, True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

        layer.core.forward = dense  # type: ignore[method-assign,assignment]
    plan = plan_sparse_blocks(length, length, BLOCK, Visibility(causal=True, segments=segments.cpu()))
    causal = plan_sparse_blocks(length, length, BLOCK, Visibility(causal=True))
    with PeakGrowth(device) as peak:
        start = time.perf_counter()
        layer(x, documents).sum().backward()
    seconds = time.perf_counter() - start
    return {
        "variant": variant,
        "length": length,
        "peak_mib": round(peak.bytes / 2**20, 1),
        "seconds": round(seconds, 2),
        "blocks_skipped": round(plan.skipped / plan.total, 3),
        "causal_blocks_skipped": round(causal.skipped / plan.total, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--document", type=int, default=1024, help="mean document length in tokens")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per (variant, length)")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args)))
        return
    print(f"{'length':>7} {'variant':>12} {'peak MiB':>9} {'x causal':>8} {'seconds':>8} {'skipped':>8}")
    for length in args.lengths:
        floor = None
        for variant in args.variants:
            command = [sys.executable, "-m", "polyshard.bench.attention_cores", "--one", variant, str(length)]
            command += _options(args)
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
                print(f"{length:>7} {variant:>12} failed: {str(err)[:120]}")
                continue
            if variant == "causal-sdpa":
                floor = row["peak_mib"]
            ratio = f"{row['peak_mib'] / floor:.2f}" if floor else "-"
            print(
                f"{length:>7} {variant:>12} {row['peak_mib']:>9} {ratio:>8} {row['seconds']:>8} "
                f"{row['blocks_skipped']:>8}"
            )


def _options(args: argparse.Namespace) -> list[str]:
    return [
        f"--hidden={args.hidden}",
        f"--heads={args.heads}",
        f"--kv-heads={args.kv_heads}",
        f"--document={args.document}",
        f"--device={args.device}",
        f"--threads={args.threads}",
    ]


if __name__ == "__main__":
    main()
