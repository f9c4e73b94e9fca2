"""Ring and all-gather attention with document masking against ``F.scaled_dot_product_attention`` with
the block-diagonal causal mask on the full sequence on one process, and the blocks the ring skips."""

import pytest
import torch
import torch.nn.functional as F

import polyshard.cp.ring
from polyshard.cp import ContextParallelError, context_parallel_attention, shard_sequence, unshard_sequence
from polyshard.models.common import document_mask

from ._dense import segments_of

# As tests/cp/test_parity.py: float32 per-block softmaxes merged by log-sum-exp add the same terms in
# another order than one softmax: a few float32 ulps of O(1) values, well under 1e-5.
TOL = 1e-5


def _parity(style, lengths, heads=4, kv_heads=2, dim=8):
    group = None
    seq = sum(lengths[0])
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (
        torch.randn(len(lengths), h, seq, dim, generator=g) for h in (heads, kv_heads, kv_heads, heads)
    )
    segments = segments_of(lengths)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, attn_mask=document_mask(segments, segments, True), enable_gqa=True)
    ref.backward(grad_out)

    local = [shard_sequence(t, 2, group).detach().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, group, style=style, segments=shard_sequence(segments, 1, group))
    out.backward(shard_sequence(grad_out, 2, group))
    ours = [unshard_sequence(t, 2, group) for t in [out.detach()] + [t.grad for t in local]]
    return ours, [ref.detach()] + [t.grad for t in full]


# cp=2: chunks of 3 over S=12; a document of one token, one crossing two chunk boundaries, a row that is
# one document. cp=4: chunks of 2 over S=16.
CASES = [
    pytest.param(2, [[1, 7, 4], [12], [5, 2, 5]], id="cp2"),
    pytest.param(4, [[3, 9, 1, 3], [16]], id="cp4"),
]


@pytest.mark.parametrize("style", ["ring", "allgather"])
@pytest.mark.parametrize("cp, lengths", CASES)
def test_document_masked_attention_matches_sdpa(distributed, cp, lengths, style):
    for rank, (ours, refs) in enumerate(distributed.run(cp, _parity, style, lengths)):
        for name, mine, ref in zip(("out", "dq", "dk", "dv"), ours, refs):
            assert not mine.isnan().any(), f"{name} on rank {rank}"
            torch.testing.assert_close(
                mine, ref, rtol=TOL, atol=TOL, msg=lambda m, w=f"{name}, rank {rank}": f"{w}: {m}"
            )


def _blocks_computed(lengths):
    calls = []
    forward = polyshard.cp.ring.block_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    polyshard.cp.ring.block_forward = counting
    try:
        _parity("ring", lengths)
    finally:
        polyshard.cp.ring.block_forward = forward
    return len(calls)


def test_the_ring_skips_blocks_no_query_may_see(distributed):
    # cp=2, S=12, chunks of 3. Without documents each rank computes 5 blocks (2 diagonal, 3 full). With
    # one document per chunk only the 2 diagonal blocks remain; with the whole row one document, all 5.
    assert distributed.run(2, _blocks_computed, [[3, 3, 3, 3]]) == [2, 2]
    assert distributed.run(2, _blocks_computed, [[12]]) == [5, 5]


def _bad_segments():
    q = torch.zeros(1, 2, 4, 8)
    try:
        context_parallel_attention(q, q, q, None, segments=torch.zeros(1, 3, dtype=torch.int64))
    except ContextParallelError as err:
        return str(err)
    return None


def test_segments_of_the_wrong_shape_are_named(distributed):
    assert "(B, S_local) = (1, 4)" in distributed.run(2, _bad_segments)[0]
