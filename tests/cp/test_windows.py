"""Ring and all-gather attention with sliding windows and sinks (and documents) against the dense
single-process reference (:func:`polyshard.models.common.cores.dense_attention`) on cp 2 and an uneven
cp 3, and the blocks the ring skips outside a window."""

import pytest
import torch

import polyshard.cp.ring
from polyshard.cp import ContextParallelError, context_parallel_attention

from ._dense import against_dense

# As tests/cp/test_parity.py: float32 per-block softmaxes merged by log-sum-exp (and dK/dV summed round the
# ring, dsinks summed over ranks) add the same terms in another order: a few float32 ulps, well under 1e-5.
TOL = 1e-5


def _parity(style, lengths, window, use_sinks):
    def attend(q, k, v, segments, window, sinks):
        return context_parallel_attention(q, k, v, style=style, segments=segments, window=window, sinks=sinks)

    return against_dense(attend, lengths, window, use_sinks)


# cp 2: S = 12, chunks of 3; cp 3: S = 18, chunks of 3 (an odd number of ranks). A row that is one
# document and a row of documents crossing chunk boundaries, one of a single token.
CASES = [
    pytest.param(2, [[12], [1, 7, 4]], id="cp2"),
    pytest.param(3, [[18], [5, 1, 9, 3]], id="cp3"),
]


# Windows of 1, 4 (inside a chunk and across) and 7 (across several chunks), with and without sinks, and
# sinks without a window (documents alone: tests/cp/test_documents.py). One worker call runs them all.
SETTINGS = [(window, sinks) for window in (1, 4, 7) for sinks in (False, True)] + [(None, True)]


def _all_settings(style, lengths):
    return [_parity(style, lengths, window, use_sinks) for window, use_sinks in SETTINGS]


@pytest.mark.parametrize("style", ["ring", "allgather"])
@pytest.mark.parametrize("cp, lengths", CASES)
def test_windows_and_sinks_match_the_dense_reference(distributed, cp, lengths, style):
    for rank, results in enumerate(distributed.run(cp, _all_settings, style, lengths)):
        for (window, use_sinks), (ours, refs) in zip(SETTINGS, results):
            assert len(ours) == len(refs) == (5 if use_sinks else 4)
            for name, mine, ref in zip(("out", "dq", "dk", "dv", "dsinks"), ours, refs):
                where = f"{name}, rank {rank}, window {window}, sinks {use_sinks}"
                assert not mine.isnan().any(), where
                torch.testing.assert_close(mine, ref, rtol=TOL, atol=TOL, msg=lambda m, w=where: f"{w}: {m}")


def _blocks_computed(lengths, window):
    calls = []
    forward = polyshard.cp.ring.block_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    polyshard.cp.ring.block_forward = counting
    try:
        _parity("ring", lengths, window, False)
    finally:
        polyshard.cp.ring.block_forward = forward
    return len(calls)


def test_the_ring_skips_blocks_outside_the_window(distributed):
    # cp 2, S = 12, chunks of 3 (positions 0-2, 3-5, 6-8, 9-11). Without a window each rank computes 5
    # blocks. A window of 3: chunk i sees only chunks i and i - 1 (its first query is 3 past chunk i - 1's
    # first key but 1 past its last). Rank 0 (chunks 0, 3): 0x0, 3x3, 3x2 -> 3; rank 1 (chunks 1, 2): 1x1,
    # 1x0, 2x2, 2x1 -> 4. A window of 1 leaves only the diagonal blocks: 2 each.
    assert distributed.run(2, _blocks_computed, [[12]], None) == [5, 5]
    assert distributed.run(2, _blocks_computed, [[12]], 3) == [3, 4]
    assert distributed.run(2, _blocks_computed, [[12]], 1) == [2, 2]


def _bad(**kwargs):
    q = torch.zeros(1, 2, 4, 8)
    try:
        context_parallel_attention(q, q, q, None, **kwargs)
    except ContextParallelError as err:
        return str(err)
    return None


def test_bad_windows_and_sinks_are_named(distributed):
    assert "needs causal attention" in distributed.run(2, _bad, causal=False, window=4)[0]
    assert "one logit per query head, shape (2,)" in distributed.run(2, _bad, sinks=torch.zeros(3))[0]
