"""Ulysses and the 2-D Ulysses x ring scheme against ``F.scaled_dot_product_attention`` on the full sequence
on one process: outputs and dQ/dK/dV gathered back into sequence order, with grouped-query attention
(kv heads split or replicated), value heads of another width than the queries' (as MLA), document masks,
cp = 2, 3 (uneven: 6 heads) and 4, and the 2-D scheme on 4 ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyshard.cp import (
    ContextParallelAttention,
    ContextParallelError,
    context_parallel_attention,
    kv_copies,
    shard_sequence,
    split_context_group,
    ulysses_ring_groups,
    unshard_sequence,
)
from polyshard.models.common import document_mask

from ._dense import segments_of

# float32. Ulysses runs SDPA itself on whole sequences: the same kernel as the reference on the same
# numbers, only on fewer heads, so differences are at most a few ulps (0 seen on most cases). The 2-D
# scheme merges ring blocks by log-sum-exp: as tests/cp/test_parity.py, a few float32 ulps, under 1e-5.
TOL = 1e-5


def _parity(style, heads, kv_heads, *, causal=True, dim=8, value_dim=8, chunk=2, batch=1, lengths=None, ulysses=0):
    cp = dist.get_world_size()
    seq = 2 * cp * chunk if lengths is None else sum(lengths[0])
    batch = batch if lengths is None else len(lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, generator=g)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g)
    v = torch.randn(batch, kv_heads, seq, value_dim, generator=g)
    grad_out = torch.randn(batch, heads, seq, value_dim, generator=g)
    segments = None if lengths is None else segments_of(lengths)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = None if segments is None else document_mask(segments, segments, causal)
    ref = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=True)
    ref.backward(grad_out)

    group, ring_group = None, None
    if ulysses:  # the 2-D scheme: all-to-all over neighbouring ranks, ring across them
        group, ring_group = ulysses_ring_groups([list(range(cp))], ulysses)
    local = [shard_sequence(t, 2).detach().requires_grad_() for t in (q, k, v)]
    local_segments = None if segments is None else shard_sequence(segments, 1)
    out = context_parallel_attention(
        *local, group, causal=causal, style=style, segments=local_segments, ring_group=ring_group
    )
    out.backward(shard_sequence(grad_out, 2))
    ours = [unshard_sequence(t, 2) for t in [out.detach()] + [t.grad for t in local]]
    return ours, [ref.detach()] + [t.grad for t in full]


def _check(results):
    for rank, (ours, refs) in enumerate(results):
        for name, mine, ref in zip(("out", "dq", "dk", "dv"), ours, refs):
            torch.testing.assert_close(
                mine, ref, rtol=TOL, atol=TOL, msg=lambda m, w=f"{name}, rank {rank}": f"{w}: {m}"
            )


CASES = [
    pytest.param(2, 4, 2, {}, id="cp2-gqa"),
    pytest.param(2, 4, 1, {"value_dim": 6, "batch": 2}, id="cp2-mqa-replicated-kv-value-dim-6"),
    pytest.param(3, 6, 3, {"chunk": 1}, id="cp3-6-heads"),
    pytest.param(3, 6, 6, {"causal": False}, id="cp3-full"),
    pytest.param(4, 8, 2, {"value_dim": 12}, id="cp4-kv-replicated-twice"),
    pytest.param(4, 4, 4, {"lengths": [[3, 9, 1, 3], [16]]}, id="cp4-documents"),
    pytest.param(2, 4, 2, {"lengths": [[1, 7, 4], [12], [5, 2, 5]]}, id="cp2-documents"),
]


@pytest.mark.parametrize("cp, heads, kv_heads, kwargs", CASES)
def test_ulysses_matches_sdpa(distributed, cp, heads, kv_heads, kwargs):
    _check(distributed.run(cp, _parity, "ulysses", heads, kv_heads, **kwargs))


TWO_D = [
    pytest.param(2, 2, 1, {}, id="gqa-kv-replicated"),
    pytest.param(6, 2, 2, {"value_dim": 6, "causal": False}, id="full-value-dim-6"),
    pytest.param(2, 2, 2, {"lengths": [[3, 9, 1, 3], [16]]}, id="documents"),
]


@pytest.mark.parametrize("heads, kv_heads, ulysses, kwargs", TWO_D)
def test_ulysses_times_ring_on_four_ranks(distributed, heads, kv_heads, ulysses, kwargs):
    # cp = 4 = 2 x 2: all-to-all over [0, 1] and [2, 3], ring over [0, 2] and [1, 3].
    _check(distributed.run(4, _parity, "ulysses+ring", heads, kv_heads, ulysses=ulysses, **kwargs))


def test_groups_of_the_two_d_scheme():
    assert split_context_group([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert split_context_group([1, 3, 5, 7, 9, 11], 3) == ([[1, 3, 5], [7, 9, 11]], [[1, 7], [3, 9], [5, 11]])
    with pytest.raises(
        ContextParallelError, match=r"cp_ulysses=4 does not divide cp=6: .*; choose cp_ulysses in \[1, 2, 3, 6\]"
    ):
        split_context_group(range(6), 4)


def test_heads_that_do_not_split_name_the_sizes_that_do():
    assert kv_copies(8, 2, 4) == 2 and kv_copies(8, 8, 4) == 1 and kv_copies(4, 1, 4) == 4
    with pytest.raises(
        ContextParallelError, match=r"6 query and 6 key/value heads.*choose the Ulysses size in \[1, 2, 3, 6\]"
    ):
        kv_copies(6, 6, 4)
    with pytest.raises(ContextParallelError, match=r"8 query and 3 key/value"):
        kv_copies(8, 3, 2)  # kv heads neither divide by 2 nor divide it (8 query heads cannot share 3 anyway)


def _refused(style):
    q = torch.zeros(1, 6, 4, 8)
    try:
        ContextParallelAttention(style=style)(q, q, q, is_causal=True)
    except ContextParallelError as err:
        return str(err)
    return None


def test_errors_reach_the_caller(distributed):
    assert "choose the Ulysses size in [1, 2, 3, 6]" in distributed.run(4, _refused, "ulysses")[0]
    assert "needs ring_group" in distributed.run(2, _refused, "ulysses+ring")[0]
