"""Benchmark (not a test), one process: how the experts run, against the alternatives.

    python -m polyshard.bench.ep          (this section first, then expert parallelism under torchrun)

Two comparisons, each a forward + backward on the same rows and weights, timed alternately:

* **grouped vs loop**: :class:`GroupedExperts` (one ``torch._grouped_mm`` per weight over every
  expert's rows) against a Python loop of three matmuls per expert, at 8 and 32 experts.
* **layer vs a torch-ops MoE**: our whole :class:`MoELayer` (router, dispatch, grouped experts,
  combine, aux loss) against a mixture of experts written directly in torch ops the way compiled
  stacks write one (torchtitan's style: sort the assignments by expert, gather the rows, grouped
  matmuls, scale and ``index_add`` back), sharing our weights. It is the peer: ratio = ours / peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from polyshard.bench.timing import Record, comparison_record, time_interleaved
from polyshard.models.common.moe.config import MoEConfig
from polyshard.models.common.moe.experts import GroupedExperts
from polyshard.models.common.moe.layer import MoELayer
from polyshard.models.common.moe.router import load_balancing_loss

# float32 both sides; the loop and the grouped kernel sum in the same order on CPU (bitwise in the
# tests), the torch-ops MoE adds the k contributions of a token in another order: ulp-level.
MATCH_RTOL, MATCH_ATOL = 1e-5, 1e-6


def loop_experts(experts: GroupedExperts, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """The replaced implementation: for each expert, three matmuls on its contiguous rows."""
    outputs, start = [], 0
    for e, count in enumerate(counts):
        rows = x[start : start + count]
        start += count
        assert experts.w3 is not None
        h = F.silu(rows @ experts.w1[e]) * (rows @ experts.w3[e])
        outputs.append(h @ experts.w2[e])
    return torch.cat(outputs)


class TorchOpsMoE(nn.Module):
    """A dropless top-k MoE written directly in torch ops, holding the same tensors as ``layer``."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.router, self.experts = layer.router, layer.experts
        self.num_experts, self.top_k = layer.config.num_experts, layer.config.top_k
        self.aux_loss_coef = layer.config.aux_loss_coef

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routing = self.router(x)  # (T, E) scores, (T, k) weights and ids
        flat = routing.experts.reshape(-1)  # (T*k,)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        token = order // self.top_k
        offsets = counts.cumsum(0).to(torch.int32)
        rows = x[token]  # (T*k, H)
        w = self.experts
        assert w.w3 is not None
        h = F.silu(torch._grouped_mm(rows, w.w1, offs=offsets)) * torch._grouped_mm(rows, w.w3, offs=offsets)
        out = torch._grouped_mm(h, w.w2, offs=offsets) * routing.weights.reshape(-1)[order, None].to(x.dtype)
        y = torch.zeros_like(x).index_add_(0, token, out)
        return y, self.aux_loss_coef * load_balancing_loss(routing, self.num_experts)


def _fwd_bwd(fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    for p in params:
        p.grad = None
    y = fn()
    (y * target).sum().backward()
    return y.detach()


def grouped_vs_loop(*, experts: int, rows: int, hidden: int, ffn: int, iters: int) -> Record:
    torch.manual_seed(0)
    module = GroupedExperts(experts, hidden, ffn)
    g = torch.Generator().manual_seed(1)
    choice = torch.randint(0, experts, (rows,), generator=g)
    counts = torch.bincount(choice, minlength=experts).tolist()  # uneven groups, as routing makes them
    x = torch.randn(rows, hidden, generator=g, requires_grad=True)
    target = torch.randn(rows, hidden, generator=g)
    params = [x, *module.parameters()]

    def grouped() -> torch.Tensor:
        return _fwd_bwd(lambda: module(x, counts), params, target)

    def loop() -> torch.Tensor:
        return _fwd_bwd(lambda: loop_experts(module, x, counts), params, target)

    ours_s, peer_s = time_interleaved(grouped, loop, group=None, iters=iters)
    match = torch.allclose(grouped(), loop(), rtol=MATCH_RTOL, atol=MATCH_ATOL)
    kernel = "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "padded bmm"
    return comparison_record(
        f"experts E={experts} rows={rows} {hidden}x{ffn}: grouped ({kernel}) vs loop", ours_s, peer_s, match
    )


def layer_vs_torch_ops(*, experts: int, tokens: int, hidden: int, ffn: int, top_k: int, iters: int) -> Record:
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(ffn_hidden=ffn, num_experts=experts, top_k=top_k), hidden=hidden)
    peer = TorchOpsMoE(layer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    target = torch.randn(tokens, hidden, generator=g)
    params = [x, *layer.parameters()]

    def step(module: nn.Module) -> torch.Tensor:
        def run() -> torch.Tensor:
            y, aux = cast(tuple[torch.Tensor, torch.Tensor], module(x))
            return y + aux  # the aux loss's gradient flows as in training

        return _fwd_bwd(run, params, target)

    ours_s, peer_s = time_interleaved(lambda: step(layer), lambda: step(peer), group=None, iters=iters)
    match = torch.allclose(step(layer), step(peer), rtol=MATCH_RTOL, atol=MATCH_ATOL)
    return comparison_record(
        f"MoE layer E={experts} top{top_k} T={tokens} {hidden}x{ffn}: ours vs torch-ops grouped MoE",
        ours_s,
        peer_s,
        match,
        ours_tokens_per_s=tokens / ours_s,
        peer_tokens_per_s=tokens / peer_s,
    )


def compare(*, iters: int = 10, rows: int = 4096, hidden: int = 256, ffn: int = 704) -> list[Record]:
    """Grouped vs loop at 8 and 32 experts; the layer vs the torch-ops MoE at 8 and 32 experts, top-2."""
    records = [grouped_vs_loop(experts=e, rows=rows, hidden=hidden, ffn=ffn, iters=iters) for e in (8, 32)]
    records += [
        layer_vs_torch_ops(experts=e, tokens=rows // 2, hidden=hidden, ffn=ffn, top_k=2, iters=iters) for e in (8, 32)
    ]
    return records


def report(records: Sequence[Record]) -> None:
    for r in records:
        speed = f"{1 / r['ratio']:.2f}x faster" if r["ratio"] < 1 else f"{r['ratio']:.2f}x slower"
        print(
            f"{r['case']}: ours {1e3 * r['ours_s']:.1f} ms, peer {1e3 * r['peer_s']:.1f} ms, "
            f"ratio {r['ratio']:.2f} ({speed}), outputs match: {r['outputs_match']}",
            flush=True,
        )
