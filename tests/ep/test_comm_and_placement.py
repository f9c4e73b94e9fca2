"""Communication volume (byte ledger) and placement records of the expert-parallel layer.

Per layer and step the ledger must show, on the ep group: forward = the small
counts all-to-all + two payload all-to-alls (dispatch, combine); backward = two
payload all-to-alls; each with exactly the rows the routing implies.
"""

import pytest
import torch
import torch.distributed as dist

from polyshard.collectives import CommLedger
from polyshard.ep import sync_gradients
from polyshard.mesh import Replicate, Shard, get_placement

from .common import ep_mesh, make_layer, parallel_copy, rank_tokens

TOKENS, HIDDEN, NUM_EXPERTS = 10, 16, 8
FLOAT, INT64 = 4, 8  # bytes per element


def _routed_counts(layer, xs, top_k):
    """(P, P) rows rank i sends to rank j, computed from the routing of every rank's tokens."""
    world = len(xs)
    per_rank = NUM_EXPERTS // world
    sends = torch.zeros(world, world, dtype=torch.long)
    for i, x in enumerate(xs):
        with torch.no_grad():
            experts = layer.router(x).experts  # (T, k)
        sends[i] = torch.bincount(experts.reshape(-1) // per_rank, minlength=world)
    assert int(sends.sum()) == world * TOKENS * top_k
    return sends


def _ledger(top_k):
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ep_mesh()
    reference = make_layer(top_k=top_k, num_experts=NUM_EXPERTS, hidden=HIDDEN)
    xs = rank_tokens(world, TOKENS, HIDDEN)
    sends = _routed_counts(reference, xs, top_k)
    layer = parallel_copy(reference, mesh)
    group = mesh.group("ep")

    x = xs[rank].requires_grad_()  # as in a model: the layer's input needs a gradient too
    with CommLedger() as forward:
        y, aux = layer(x)
    with CommLedger() as backward:
        (y.square().mean() + aux).backward()
    with CommLedger() as sync:
        sync_gradients(layer, group)

    sent, received = int(sends[rank].sum()), int(sends[:, rank].sum())  # A and N rows
    row = HIDDEN * FLOAT
    # Forward: counts (E int64) + dispatch (A rows in) + combine (N rows in).
    assert forward.calls("all_to_all", group) == 3 and forward.calls() == 3
    assert forward.total("all_to_all", group) == NUM_EXPERTS * INT64 + (sent + received) * row
    to_others = sent - int(sends[rank, rank])
    from_others = received - int(sends[rank, rank])
    counts_wire = (NUM_EXPERTS - NUM_EXPERTS // world) * INT64
    assert forward.wire("all_to_all", group) == counts_wire + (to_others + from_others) * row
    # Backward: the two payload exchanges reversed (combine's first: A rows in; then dispatch's: N rows in).
    assert backward.calls("all_to_all", group) == 2 and backward.calls() == 2
    assert backward.total("all_to_all", group) == (sent + received) * row
    assert backward.wire("all_to_all", group) == (to_others + from_others) * row
    # Gradient sync: one all-reduce of the replicated router weight; expert grads need no communication.
    assert sync.calls() == 1
    assert sync.total("all_reduce", group) == reference.router.weight.numel() * FLOAT
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("top_k", [1, 2])
def test_ledger_shows_two_payload_all_to_alls_each_way(distributed, world, top_k):
    assert distributed.run(world, _ledger, top_k) == [True] * world


def _placements():
    mesh = ep_mesh()
    world, rank = mesh.size("ep"), mesh.coord("ep")
    reference = make_layer(num_experts=NUM_EXPERTS)
    layer = parallel_copy(reference, mesh)
    axis_sizes, coords = {"ep": world}, {"ep": rank}
    for name in ("w1", "w2", "w3"):
        local, full = getattr(layer.experts, name), getattr(reference.experts, name)
        record = get_placement(local)
        assert record.name == f"experts.{name}"
        assert record.global_shape == tuple(full.shape)
        assert record.placement("ep") == Shard(0)
        assert record.local_shape(axis_sizes) == tuple(local.shape) == (NUM_EXPERTS // world, *full.shape[1:])
        # The record alone says where this shard sits in the global tensor.
        torch.testing.assert_close(local, full[record.local_slices(axis_sizes, coords)], rtol=0, atol=0)
    assert get_placement(layer.router.weight).placement("ep") == Replicate()
    return True


def test_expert_parameters_carry_shard_records(distributed):
    assert distributed.run(4, _placements) == [True] * 4
