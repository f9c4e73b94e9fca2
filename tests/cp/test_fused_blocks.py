"""A block with no mask of its own runs ATen's fused CPU flash-attention kernel (polyshard.cp.blocks); it must
give the reference kernel's out, lse and gradients, grouped-query heads, diagonal blocks, merged partial
results and sinks included, and a block with a mask, another dtype or unequal head dims keeps the reference."""

import pytest
import torch

from polyshard.cp.blocks import add_sinks, block_backward, block_forward, fused_available, merge_into
from polyshard.cp.blocksparse import Visibility, plan_sparse_blocks

# Both kernels are float32 softmax attention over the same keys: the fused one sums its blocked softmax and
# its gradient products in another order, a few float32 ulps of values of order 1 (24-48 terms): under 1e-5.
TOL = 1e-5


def _tensors(queries=24, keys=24, heads=2, group=3, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, group, queries, dim, generator=g)
    k, v = (torch.randn(2, heads, 1, keys, dim, generator=g) for _ in range(2))
    return q, k, v, torch.randn(2, heads, group, queries, dim, generator=g)


def _reference_forward(q, k, v, scale, diagonal):
    hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1) if diagonal else None
    # the same block through the reference path: a mask (here the triangle itself) keeps it off the fused kernel
    return block_forward(q, k, v, scale, False, hidden) if diagonal else _reference_full(q, k, v, scale)


def _reference_full(q, k, v, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


@pytest.mark.parametrize("diagonal", [False, True], ids=["full", "diagonal"])
def test_fused_block_equals_the_reference(diagonal):
    q, k, v, dout = _tensors()
    scale = q.shape[-1] ** -0.5
    assert fused_available(q, k, v, None)
    out, lse = block_forward(q, k, v, scale, diagonal)
    ref_out, ref_lse = _reference_forward(q, k, v, scale, diagonal)
    torch.testing.assert_close(out, ref_out, rtol=TOL, atol=TOL)
    torch.testing.assert_close(lse, ref_lse, rtol=TOL, atol=TOL)
    delta = (dout * out).sum(dim=-1)
    fused = block_backward(q, k, v, dout, lse, delta, scale, diagonal, None, out)
    hidden = torch.ones(24, 24, dtype=torch.bool).triu(1) if diagonal else None
    reference = block_backward(q, k, v, dout, lse, delta, scale, diagonal and hidden is None, hidden)  # no out
    for name, mine, ref in zip(("dq", "dk", "dv"), fused, reference):
        assert mine.shape == ref.shape, name
        torch.testing.assert_close(mine, ref, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_fused_blocks_merged_with_sinks_give_the_dense_gradients():
    """Two key blocks (a full one, then the diagonal) merged by lse, sinks folded in; each block's backward
    from the final out and lse, summed: the gradients of dense causal attention with sinks, by autograd."""
    q, k, v, dout = _tensors(queries=16, keys=32)
    sinks = torch.randn(6)
    scale = q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"))
    blocks = [(slice(0, 16), False), (slice(16, 32), True)]  # queries sit at positions 16..31
    for cols, diagonal in blocks:
        merge_into(out, lse, *block_forward(q, k[..., cols, :], v[..., cols, :], scale, diagonal))
    add_sinks(out, lse, sinks)
    delta = (dout * out).sum(dim=-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for cols, diagonal in blocks:
        dq_b, dk_b, dv_b = block_backward(
            q, k[..., cols, :], v[..., cols, :], dout, lse, delta, scale, diagonal, None, out
        )
        dq += dq_b
        dk[..., cols, :] += dk_b
        dv[..., cols, :] += dv_b

    qq, kk, vv, ss = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    scores = (qq @ kk.transpose(-1, -2)) * scale  # (2, 2, 3, 16, 32)
    scores = scores.masked_fill(torch.ones(16, 32, dtype=torch.bool).triu(17), float("-inf"))
    sink = ss.reshape(2, 3, 1, 1).expand(2, 2, 3, 16, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :32]
    dense = probs @ vv
    dense.backward(dout)
    torch.testing.assert_close(out, dense.detach(), rtol=TOL, atol=TOL)
    for name, mine, ref in (("dq", dq, qq.grad), ("dk", dk, kk.grad), ("dv", dv, vv.grad)):
        torch.testing.assert_close(mine, ref, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_blocks_the_fused_kernel_cannot_take_keep_the_reference():
    q, k, v, _ = _tensors()
    assert not fused_available(q, k, v, torch.zeros(24, 24, dtype=torch.bool))  # a mask of its own
    assert not fused_available(q.double(), k.double(), v.double(), None)
    assert not fused_available(q, k, v[..., :4], None)  # values narrower than keys (MLA's shape)
    out, lse = block_forward(q, k, v[..., :4], q.shape[-1] ** -0.5, True)  # the reference runs it
    assert out.shape[-1] == 4 and lse.isfinite().all()


def test_only_the_plain_causal_diagonal_loses_its_mask():
    plan = plan_sparse_blocks(8, 8, 4, Visibility(True))
    kinds = [(hidden is None, diagonal) for _, _, hidden, diagonal in Visibility(True).blocks(plan, 8, 8, "cpu")]
    assert kinds == [(True, True), (True, False), (True, True)]  # diagonal, full, diagonal
    windowed = Visibility(True, window=3)
    plan = plan_sparse_blocks(8, 8, 4, windowed)
    assert all(not diagonal for *_, diagonal in windowed.blocks(plan, 8, 8, "cpu"))
    assert any(hidden is not None for _, _, hidden, _ in windowed.blocks(plan, 8, 8, "cpu"))
