"""The attention cores against the dense reference (one S x S mask, one softmax, autograd): outputs and the
gradients of q, k, v and the sinks, with documents, sliding windows, sinks and grouped-query heads; the
blocks the block-sparse core skips; plain causal SDPA unchanged when nothing is masked."""

import pytest
import torch
import torch.nn.functional as F

import polyshard.cp.blocksparse as blocksparse
from polyshard.models.common import Attention, CoreAttention, RopeConfig
from polyshard.models.common.cores import (
    Visibility,
    block_sparse_attention,
    dense_attention,
    flex_core,
    plan_sparse_blocks,
)

# float32 throughout. Per-block softmaxes merged by log-sum-exp (and dK/dV summed block by block) add the
# same terms in another order than one softmax over every key: a few float32 ulps of O(1) values (about
# 1e-6 seen), well under 1e-5.
TOL = 1e-5


def _segments(lengths):
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def _inputs(batch, seq, heads=4, kv_heads=2, dim=8, value_dim=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=g)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g)
    v = torch.randn(batch, kv_heads, seq, value_dim, generator=g)
    sinks = torch.randn(heads, generator=g)
    grad = torch.randn(batch, heads, seq, value_dim, generator=g)
    return q, k, v, sinks, grad


def _run(attend, inputs, use_sinks, **masks):
    q, k, v, sinks, grad = inputs
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = attend(*leaves[:3], sinks=leaves[3] if use_sinks else None, **masks)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves[: 4 if use_sinks else 3]]


# S = 22 with blocks of 4: the last block is short. Rows: documents of 1 token, one crossing block edges,
# a row that is one document. Windows of 1 (only itself), 5 (inside a block and across), 30 (> S: no effect).
CASES = [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=False), id="full"),
    pytest.param(dict(causal=True, window=5), id="window5"),
    pytest.param(dict(causal=True, window=1), id="window1"),
    pytest.param(dict(causal=True, window=30), id="window30"),
    pytest.param(dict(causal=True, lengths=[[1, 9, 4, 8], [22], [5, 17]]), id="documents"),
    pytest.param(dict(causal=False, lengths=[[1, 9, 4, 8], [22], [5, 17]]), id="documents-full"),
    pytest.param(dict(causal=True, window=6, lengths=[[1, 9, 4, 8], [22], [5, 17]]), id="documents-window"),
]


@pytest.mark.parametrize("use_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("case", CASES)
def test_block_sparse_core_matches_the_dense_reference(case, use_sinks):
    case = dict(case)
    lengths = case.pop("lengths", [[22]] * 3)
    masks = dict(case, segments=_segments(lengths))
    inputs = _inputs(len(lengths), 22)
    ref = _run(dense_attention, inputs, use_sinks, **masks)
    ours = _run(lambda *a, **kw: block_sparse_attention(*a, block=4, **kw), inputs, use_sinks, **masks)
    for name, mine, theirs in zip(("out", "dq", "dk", "dv", "dsinks"), ours, ref):
        assert not mine.isnan().any(), name
        torch.testing.assert_close(mine, theirs, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("window", [None, 4], ids=["causal", "window4"])
def test_block_sparse_queries_and_keys_placed_in_their_sequence_match_the_whole_sequence(window):
    """Queries 9..21 over keys 4..21 (all-gather cp's call: a chunk of queries over the keys it may see),
    placed by query_start / key_start, with the keys' own documents: the whole sequence's rows and the
    gradients of the keys it covers. Keys before 4 are hidden from these queries by the window (4) or,
    causal only, are outside the call, so this compares only where they are hidden anyway: documents
    start at 0, 4 and 15 (queries 9.. never see keys 0..3)."""
    lengths = [[4, 11, 7], [4, 18]]
    segments = _segments(lengths)
    inputs = _inputs(len(lengths), 22)
    ref_out, ref_dq, _, _ = _run(dense_attention, inputs, False, causal=True, window=window, segments=segments)
    q, k, v, _, grad = inputs
    rows, cols = slice(9, 22), slice(4, 22)
    leaves = [q[:, :, rows].clone().requires_grad_(), k[:, :, cols].clone().requires_grad_(), v[:, :, cols].clone()]
    leaves[2].requires_grad_()
    out = block_sparse_attention(
        *leaves,
        causal=True,
        window=window,
        segments=segments[:, rows],
        key_segments=segments[:, cols],
        query_start=9,
        key_start=4,
        block=4,
    )
    out.backward(grad[:, :, rows])
    torch.testing.assert_close(out, ref_out[:, :, rows], rtol=TOL, atol=TOL)
    torch.testing.assert_close(leaves[0].grad, ref_dq[:, :, rows], rtol=TOL, atol=TOL)
    # dK/dV of the keys: the reference's also holds the other queries' (0..8) terms; recompute it without them.
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    dense_attention(*want, causal=True, window=window, segments=segments)[:, :, rows].backward(grad[:, :, rows])
    torch.testing.assert_close(leaves[1].grad, want[1].grad[:, :, cols], rtol=TOL, atol=TOL)
    torch.testing.assert_close(leaves[2].grad, want[2].grad[:, :, cols], rtol=TOL, atol=TOL)


def _counted(lengths, window, seq=16, block=4):
    calls = {"forward": 0, "backward": 0}
    forward, backward = blocksparse.block_forward, blocksparse.block_backward

    def count(name, fn):
        def counting(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counting

    blocksparse.block_forward, blocksparse.block_backward = count("forward", forward), count("backward", backward)
    try:
        q, k, v, _, grad = _inputs(len(lengths), seq)
        q.requires_grad_()
        out = block_sparse_attention(q, k, v, causal=True, window=window, segments=_segments(lengths), block=block)
        out.backward(grad)
    finally:
        blocksparse.block_forward, blocksparse.block_backward = forward, backward
    plan = plan_sparse_blocks(seq, seq, block, Visibility(causal=True, window=window, segments=_segments(lengths)))
    return calls, plan.skipped


def test_the_block_sparse_core_skips_hidden_blocks():
    # S = 16, blocks of 4: 16 pairs, 10 on or below the causal diagonal. Documents of 4, 4 and 8 tokens:
    # only the pairs inside a document remain, (0,0) (1,1) (2,2) (3,2) (3,3): 5 computed, 11 skipped.
    assert _counted([[4, 4, 8]], None) == ({"forward": 5, "backward": 5}, 11)
    # One document, a window of 3: key block j is hidden from query block i when i's first token is 3 or
    # more past j's last, (2,0) (3,0) (3,1): 7 computed, 9 skipped.
    assert _counted([[16]], 3) == ({"forward": 7, "backward": 7}, 9)
    # Two rows: a pair is skipped only when it is hidden in both, so row 2's single document keeps all 10.
    assert _counted([[4, 4, 8], [16]], None) == ({"forward": 10, "backward": 10}, 6)


def test_plain_causal_attention_is_sdpa_bit_for_bit():
    q, k, v, _, _ = _inputs(2, 22)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(CoreAttention()(q, k, v), expected)


def test_attention_with_sinks_and_a_window_matches_the_reference():
    torch.manual_seed(0)
    attention = Attention(32, 4, 2, window=5, sinks=True, rope=RopeConfig())
    torch.nn.init.normal_(attention.sinks)
    x = torch.randn(2, 22, 32)
    out = attention(x)
    out.square().sum().backward()
    # The same layer with the dense reference as its core: every parameter's gradient, the sinks' too.
    reference = Attention(32, 4, 2, window=5, sinks=True, rope=RopeConfig())
    reference.load_state_dict(attention.state_dict())
    reference.core.forward = lambda q, k, v, sinks=None: dense_attention(q, k, v, window=5, sinks=sinks)
    expected = reference(x)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)
    for (name, mine), theirs in zip(attention.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_impossible_core_choices_are_named():
    q, k, v, _, _ = _inputs(1, 8)
    with pytest.raises(ValueError, match="core 'sdpa' takes no document mask"):
        CoreAttention(core="sdpa")(q, k, v, segments=torch.zeros(1, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="unknown; choose one of"):
        CoreAttention(core="dense")
    with pytest.raises(ValueError, match="needs causal attention"):
        CoreAttention(causal=False, window=4)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="core 'flex' needs CUDA"):
            CoreAttention(core="flex")(q, k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention runs (with a backward) only on CUDA")
@pytest.mark.parametrize("use_sinks", [False, True], ids=["", "sinks"])
def test_flex_core_matches_the_dense_reference(use_sinks):
    # On a GPU: float32 inputs, but the kernels may use TF32 matmuls; 2e-3 covers TF32's 10-bit mantissa.
    lengths = [[1, 9, 4, 18], [32]]
    masks = dict(causal=True, window=6, segments=_segments(lengths).cuda())
    inputs = [t.cuda() for t in _inputs(2, 32)]
    ref = _run(dense_attention, inputs, use_sinks, **masks)
    ours = _run(flex_core, inputs, use_sinks, **masks)
    for name, mine, theirs in zip(("out", "dq", "dk", "dv", "dsinks"), ours, ref):
        torch.testing.assert_close(mine, theirs, rtol=2e-3, atol=2e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_bfloat16_inputs_and_an_empty_batch():
    # bf16 in, bf16 out and gradients, computed in float32 inside: within bf16's rounding of the float32
    # reference (8 mantissa bits, 2^-8 relative; 2e-2 leaves room for the inputs' own rounding).
    lengths = [[3, 9, 10], [22]]
    masks = dict(causal=True, window=6, segments=_segments(lengths))
    inputs = _inputs(2, 22)
    ref = _run(dense_attention, [t.bfloat16().float() for t in inputs], True, **masks)
    ours = _run(block_sparse_attention, [t.bfloat16() for t in inputs], True, **masks)
    for name, mine, theirs in zip(("out", "dq", "dk", "dv", "dsinks"), ours, ref):
        assert mine.dtype == torch.bfloat16, name
        torch.testing.assert_close(mine.float(), theirs, rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"{n}: {m}")
    # Evaluation's last part may hold no rows: nothing to attend, no error.
    q, k, v, sinks, _ = _inputs(0, 22)
    out = block_sparse_attention(q, k, v, segments=torch.zeros(0, 22, dtype=torch.int64), sinks=sinks, block=4)
    assert out.shape == (0, 4, 22, 6)
