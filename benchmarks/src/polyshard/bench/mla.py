"""Multi-head latent attention (DeepSeek's MLA) against grouped-query attention of the same model width:
KV-cache bytes per token and layer, and one attention layer's forward + backward time at each length.

    python -m polyshard.bench.mla --lengths 2048 8192

The MLA layer has DeepSeek-V2-Lite's proportions at a smaller width (16 heads; q and k 64 + 32 rotary dims,
v 64; a kv latent of 256 and a q latent of 384); the GQA layer has the same 16 heads of 64 dims and 4 kv
heads (Llama's grouping). Both run causal attention through the same core (SDPA on one row; MLA pads
its values with zeros to the q/k head dim there, so SDPA's fused kernel runs rather than the S x S fallback). The cache
counts what an inference cache would keep per token and layer in bf16: MLA's latent and shared rotary key,
GQA's k and v heads. Times are the median of ``--repeats`` steps after one warm-up; time them on an idle
machine. Standalone: it needs torch and polyshard-models only.
"""

from __future__ import annotations

import argparse
import statistics
import time


def layers(hidden: int, heads: int, kv_heads: int, kv_lora: int, q_lora: int):  # type: ignore[no-untyped-def]
    """(MLA layer, GQA layer), float32 on the CPU."""
    from polyshard.models.common import MLA, Attention, RopeConfig

    mla = MLA(hidden, heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=64, qk_rope_head_dim=32,
              v_head_dim=64, rope=RopeConfig())  # fmt: skip
    gqa = Attention(hidden, heads, kv_heads, bias=False, rope=RopeConfig(), head_dim=64)
    return mla, gqa


def cache_bytes(kind: str, kv_heads: int, kv_lora: int, element: int = 2) -> int:
    """Bytes an inference cache keeps per token and layer."""
    from polyshard.models.common import kv_cache_width

    return (kv_cache_width(kv_lora, 32) if kind == "mla" else 2 * kv_heads * 64) * element


def step_seconds(layer, length: int, hidden: int, repeats: int) -> float:  # type: ignore[no-untyped-def]
    import torch

    x = torch.randn(1, length, hidden, requires_grad=True)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        layer(x).sum().backward()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--kv-lora", type=int, default=256)
    parser.add_argument("--q-lora", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mla, gqa = layers(args.hidden, args.heads, args.kv_heads, args.kv_lora, args.q_lora)
    params = {"mla": sum(p.numel() for p in mla.parameters()), "gqa": sum(p.numel() for p in gqa.parameters())}
    print(
        f"{'layer':>5} {'params':>10} {'KV B/token':>10} " + " ".join(f"{f'fwd+bwd s @{n}':>14}" for n in args.lengths)
    )
    for kind, layer in (("mla", mla), ("gqa", gqa)):
        cache = cache_bytes(kind, args.kv_heads, args.kv_lora)
        seconds = [step_seconds(layer, n, args.hidden, args.repeats) for n in args.lengths]
        print(f"{kind:>5} {params[kind]:>10,} {cache:>10} " + " ".join(f"{s:>14.3f}" for s in seconds))


if __name__ == "__main__":
    main()
