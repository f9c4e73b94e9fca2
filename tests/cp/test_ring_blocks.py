"""Ring attention walks each (query chunk, key chunk) pair in key/value blocks: with chunks that hold several
blocks and several documents, it equals the dense single-process reference
(:func:`polyshard.models.common.cores.dense_attention`), with windows and sinks too, on cp 2 and an uneven
cp 3; and it computes only the blocks that hold a visible key, in the forward and in the backward."""

import pytest
import torch

import polyshard.cp.ring as ring

from ._dense import against_dense

# As tests/cp/test_parity.py: float32 per-block softmaxes merged by log-sum-exp (and dK/dV summed round the
# ring, dsinks summed over ranks) add the same terms in another order: a few float32 ulps, well under 1e-5.
TOL = 1e-5


def _parity(lengths, window, use_sinks, block):
    def attend(q, k, v, segments, window, sinks):  # the default scale, blocks of ``block`` inside each chunk
        return ring.ring_attention(q, k, v, None, True, q.shape[-1] ** -0.5, segments, window, sinks, block=block)

    return against_dense(attend, lengths, window, use_sinks)


# Chunks of 12 tokens: cp 2 over S = 48, cp 3 over S = 72. Blocks of 4 (three per chunk) on cp 2 and of 5 on
# cp 3 (5, 5 and a short 2). Row 1: documents of 1 to 17 tokens, several in each chunk, crossing block and
# chunk boundaries; row 2: long documents and one of a single token, so a block pair is skipped only when
# both rows hide it.
CASES = [
    pytest.param(2, [[5, 1, 14, 3, 9, 16], [20, 2, 2, 24]], 4, id="cp2"),
    pytest.param(3, [[5, 1, 14, 3, 9, 16, 7, 17], [40, 1, 31]], 5, id="cp3"),
]

# Documents alone; with a window of 7 (inside a chunk, across blocks) and sinks; with a window of 13 (across
# a chunk boundary). One worker call runs them all.
SETTINGS = [(None, False), (7, True), (13, False)]


def _all_settings(lengths, block):
    return [_parity(lengths, window, use_sinks, block) for window, use_sinks in SETTINGS]


@pytest.mark.parametrize("cp, lengths, block", CASES)
def test_blocks_inside_chunks_match_the_dense_reference(distributed, cp, lengths, block):
    for rank, results in enumerate(distributed.run(cp, _all_settings, lengths, block)):
        for (window, use_sinks), (ours, refs) in zip(SETTINGS, results):
            assert len(ours) == len(refs) == (5 if use_sinks else 4)
            for name, mine, ref in zip(("out", "dq", "dk", "dv", "dsinks"), ours, refs):
                where = f"{name}, rank {rank}, window {window}, sinks {use_sinks}"
                assert not mine.isnan().any(), where
                torch.testing.assert_close(mine, ref, rtol=TOL, atol=TOL, msg=lambda m, w=where: f"{w}: {m}")


def _blocks_computed(lengths, window):
    calls = {"forward": 0, "backward": 0}
    forward, backward = ring.block_forward, ring.block_backward

    def count(name, fn):
        def counting(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counting

    ring.block_forward, ring.block_backward = count("forward", forward), count("backward", backward)
    try:
        _parity(lengths, window, False, block=4)
    finally:
        ring.block_forward, ring.block_backward = forward, backward
    return calls


def _both(n):
    return {"forward": n, "backward": n}


def test_the_ring_skips_the_blocks_no_query_may_see(distributed):
    # cp 2, S = 48, chunks of 12 (rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2), blocks of 4: each
    # chunk pair is 3 x 3 blocks. Causally each rank computes 2 diagonal pairs (6 blocks each: on or below
    # the diagonal) and 3 full ones (9 each): 39 of its 45 blocks, in the forward and again in the backward.
    assert distributed.run(2, _blocks_computed, [[48]], None) == [_both(39)] * 2
    # Documents of 4 tokens, one per block: only the diagonal blocks of the diagonal pairs, 3 + 3.
    assert distributed.run(2, _blocks_computed, [[4] * 12], None) == [_both(6)] * 2
    # Documents of 6: in a diagonal pair, blocks (0-3, 4-7, 8-11) hold documents {0}, {0, 1}, {1}; query
    # block 2 shares none with key block 0, so 5 of the 6 remain. The chunk pairs share no document: 5 + 5.
    assert distributed.run(2, _blocks_computed, [[6] * 8], None) == [_both(10)] * 2
    # One document, a window of 5: in a diagonal pair query block i sees key blocks i and i - 1 (the first
    # query of block i + 2 is 5 past the last key of block i), 5 blocks; in a pair of neighbouring chunks only
    # the first query block against the last key block (1 past it), 1 block; chunks further apart are
    # skipped whole. Rank 0: pairs 0x0, 3x3, 3x2 -> 11; rank 1: 1x1, 2x2, 2x1, 1x0 -> 12.
    assert distributed.run(2, _blocks_computed, [[48]], 5) == [_both(11), _both(12)]
