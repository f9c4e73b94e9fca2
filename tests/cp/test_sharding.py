"""The load-balanced layout: which positions each rank holds, round trips, position ids, and which
blocks the ring computes (skipped blocks, equal work per rank)."""

import pytest
import torch
import torch.distributed as dist

from polyshard.cp import (
    Block,
    local_positions,
    plan_blocks,
    position_ids,
    rank_chunks,
    shard_sequence,
    to_sequence_order,
    unshard_sequence,
)


def test_the_pictures_in_the_docstring():
    # cp=2, S=8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert [local_positions(8, r, 2).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [local_positions(16, r, 4).tolist() for r in range(4)] == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    assert local_positions(6, 0, 1).tolist() == list(range(6))  # cp=1: the identity


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_sequence_order_undoes_the_rank_order(cp):
    seq = torch.arange(2 * cp * 3)
    gathered = torch.cat([local_positions(seq.numel(), r, cp) for r in range(cp)])  # what an all-gather returns
    assert torch.equal(to_sequence_order(gathered, 0, cp), seq)


def test_cp2_block_plan_matches_the_worked_example():
    full, diag = False, True
    c = 2  # chunk length; local rows/cols 0:2 are the first chunk, 2:4 the second
    first, second = slice(0, 2), slice(2, 4)
    # Rank 0 (q0, q3) on its own K/V (k0, k3): q0 x k0 diagonal, q3 x k0 full, q3 x k3 diagonal. Each
    # block's offset is its first query's global position minus its first key's (a window needs it).
    assert plan_blocks(0, 0, 2, c, True) == [
        Block(first, first, diag),
        Block(second, first, full, offset=(3 - 0) * c),
        Block(second, second, diag),
    ]
    # Rank 0 on rank 1's K/V (k1, k2): only q3 sees them, fully.
    assert plan_blocks(0, 1, 2, c, True) == [
        Block(second, first, full, offset=(3 - 1) * c),
        Block(second, second, full, offset=(3 - 2) * c),
    ]
    # Rank 1 (q1, q2) on rank 0's K/V (k0, k3): both query chunks see k0, nobody sees k3.
    assert plan_blocks(1, 0, 2, c, True) == [
        Block(first, first, full, offset=(1 - 0) * c),
        Block(second, first, full, offset=(2 - 0) * c),
    ]
    assert plan_blocks(1, 0, 2, c, False) == [Block(slice(None), slice(None), False)]  # non-causal: one block


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_every_rank_does_the_same_work(cp):
    # Work in C x C blocks, a diagonal block counting half. At every ring step every rank computes
    # two blocks' worth (its own K/V: two diagonal blocks and one full; another rank's: two full),
    # so no rank waits for another: 2cp per rank in all.
    def work(query_rank, kv_rank):
        return sum(0.5 if b.diagonal else 1.0 for b in plan_blocks(query_rank, kv_rank, cp, 1, True))

    for r in range(cp):
        assert work(r, r) == 2.0  # two diagonal blocks and one full block
        assert all(work(r, src) == 2.0 for src in range(cp) if src != r)
        assert sum(work(r, src) for src in range(cp)) == 2 * cp
    total_pairs = sum(work(r, src) for r in range(cp) for src in range(cp))
    assert total_pairs == (2 * cp) ** 2 / 2  # half the (2cp)^2 chunk pairs: the causal triangle


def test_rank_chunks():
    assert [rank_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


def _round_trips():
    cp = dist.get_world_size()
    seq = 2 * cp * 3
    x = torch.randn(2, 5, seq, 4, generator=torch.Generator().manual_seed(0))
    results = []
    for dim in (2, -2):
        local = shard_sequence(x, dim)
        results.append((tuple(local.shape), torch.equal(unshard_sequence(local, dim), x)))
    tokens = torch.randn(seq, 3, generator=torch.Generator().manual_seed(1))  # sequence on dim 0
    results.append(
        (tuple(shard_sequence(tokens, 0).shape), torch.equal(unshard_sequence(shard_sequence(tokens, 0), 0), tokens))
    )
    # Position ids are the shard of arange(S), and gather back to it.
    positions = position_ids(seq)
    same_as_shard = torch.equal(positions, shard_sequence(torch.arange(seq), 0))
    gathered = torch.equal(unshard_sequence(positions, 0), torch.arange(seq))
    return results, same_as_shard, gathered, positions.dtype


@pytest.mark.parametrize("cp", [2, 4])
def test_shard_unshard_round_trip_and_position_ids(distributed, cp):
    for results, same_as_shard, gathered, dtype in distributed.run(cp, _round_trips):
        assert results == [((2, 5, 6, 4), True), ((2, 5, 6, 4), True), ((6, 3), True)]
        assert same_as_shard and gathered and dtype == torch.int64


def _gradients_through_the_helpers():
    # shard_sequence sends the gradient to this rank's positions; unshard_sequence keeps this
    # rank's piece of the gathered gradient (every rank uses the gathered tensor alike).
    cp, seq = dist.get_world_size(), 8
    x = torch.arange(seq, dtype=torch.float32).requires_grad_()
    shard_sequence(x, 0).sum().backward()
    local = (torch.ones(seq // cp) * (dist.get_rank() + 1)).requires_grad_()
    weights = torch.arange(seq, dtype=torch.float32)
    (unshard_sequence(local, 0) * weights).sum().backward()
    return x.grad.tolist(), local.grad.tolist()


def test_helpers_gradients(distributed):
    (x_grad0, local_grad0), (x_grad1, local_grad1) = distributed.run(2, _gradients_through_the_helpers)
    assert x_grad0 == [1, 1, 0, 0, 0, 0, 1, 1] and x_grad1 == [0, 0, 1, 1, 1, 1, 0, 0]
    assert local_grad0 == [0, 1, 6, 7] and local_grad1 == [2, 3, 4, 5]  # the weights at its own positions
