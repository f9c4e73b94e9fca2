"""Grouped experts: one grouped matmul over every local expert equals a matmul per expert."""

import pytest
import torch

from polyshard.models.common.moe import experts as module
from polyshard.models.common.moe.experts import GroupedExperts, grouped_mm


def _per_expert(x, w, counts):
    return torch.cat([rows @ w[e] for e, rows in enumerate(x.split(counts))])


@pytest.mark.parametrize("hidden, counts", [(32, [10, 0, 25, 15]), (7, [3, 0, 2, 0]), (32, [0, 0, 0, 0])])
def test_grouped_and_padded_equal_a_matmul_per_expert(hidden, counts, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), hidden, generator=g, requires_grad=True)
    w = torch.randn(len(counts), hidden, 48, generator=g, requires_grad=True)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = grouped_mm(x, w, counts)
    # 32 float32 columns are 16-byte aligned and there are rows: the grouped kernel; 7 columns or no
    # rows: the padded batched matmul.
    assert bool(calls) == (hidden % 4 == 0 and sum(counts) > 0)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w), grad)
    expected = torch.autograd.grad(_per_expert(x, w, counts), (x, w), grad) if sum(counts) else (x, torch.zeros_like(w))
    # Each output row is the same dot products summed in the same order: equal up to float32 round-off.
    torch.testing.assert_close(out, _per_expert(x, w, counts), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-5)
    for e, count in enumerate(counts):
        if not count:
            assert not got[1][e].any()  # an expert with no rows gets a zero gradient: AdamW leaves it as it is


def test_bf16_experts_run_grouped():
    layer = GroupedExperts(4, 32, 64).to(torch.bfloat16)
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    counts = [5, 5, 0, 10]
    h = torch.nn.functional.silu(_per_expert(x, layer.w1, counts)) * _per_expert(x, layer.w3, counts)
    # bf16 products summed in another order by the two kernels: ~1e-2 relative at these sizes.
    torch.testing.assert_close(layer(x, counts), _per_expert(h, layer.w2, counts), rtol=2e-2, atol=2e-2)
    assert module._grouped_applies(x, layer.w1)
