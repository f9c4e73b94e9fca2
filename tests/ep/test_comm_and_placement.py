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

    fwd_calls = (forward.calls("all_to_all", group), forward.calls())
    bwd_calls = (backward.calls("all_to_all", group), backward.calls())
    return {
        "sent": int(sends[rank].sum()),  # A rows
        "received": int(sends[:, rank].sum()),  # N rows
        "kept": int(sends[rank, rank]),
        "router_numel": reference.router.weight.numel(),
        "forward": (*fwd_calls, forward.total("all_to_all", group), forward.wire("all_to_all", group)),
        "backward": (*bwd_calls, backward.total("all_to_all", group), backward.wire("all_to_all", group)),
        "sync": (sync.calls(), sync.total("all_reduce", group)),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("top_k", [1, 2])
def test_ledger_shows_two_payload_all_to_alls_each_way(distributed, world, top_k):
    results = distributed.run(world, _ledger, top_k)
    assert len(results) == world
    row = HIDDEN * FLOAT
    counts_wire = (NUM_EXPERTS - NUM_EXPERTS // world) * INT64
    for r in results:
        sent, received = r["sent"], r["received"]
        to_others, from_others = sent - r["kept"], received - r["kept"]
        # Forward: counts (E int64) + dispatch (A rows in) + combine (N rows in).
        calls_on_group, calls, total, wire = r["forward"]
        assert calls_on_group == 3 and calls == 3
        assert total == NUM_EXPERTS * INT64 + (sent + received) * row
        assert wire == counts_wire + (to_others + from_others) * row
        # Backward: the two payload exchanges reversed (combine's first: A rows in; then dispatch's: N rows in).
        calls_on_group, calls, total, wire = r["backward"]
        assert calls_on_group == 2 and calls == 2
        assert total == (sent + received) * row
        assert wire == (to_others + from_others) * row
        # Gradient sync: one all-reduce of the replicated router weight; expert grads need no communication.
        calls, total = r["sync"]
        assert calls == 1
        assert total == r["router_numel"] * FLOAT
    # Every row one rank sends, some rank receives.
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results) == world * TOKENS * top_k


def _placements():
    mesh = ep_mesh()
    world, rank = mesh.size("ep"), mesh.coord("ep")
    reference = make_layer(num_experts=NUM_EXPERTS)
    layer = parallel_copy(reference, mesh)
    axis_sizes, coords = {"ep": world}, {"ep": rank}
    records = {}
    for name in ("w1", "w2", "w3"):
        local, full = getattr(layer.experts, name), getattr(reference.experts, name)
        record = get_placement(local)
        records[name] = {
            "name": record.name,
            "global_shape": record.global_shape,
            "full_shape": tuple(full.shape),
            "placement": record.placement("ep"),
            "record_local_shape": record.local_shape(axis_sizes),
            "local_shape": tuple(local.shape),
            "local": local.detach().clone(),
            "full_at_record_slices": full[record.local_slices(axis_sizes, coords)].detach().clone(),
        }
    return {"world": world, "experts": records, "router": get_placement(layer.router.weight).placement("ep")}


def test_expert_parameters_carry_shard_records(distributed):
    results = distributed.run(4, _placements)
    assert len(results) == 4
    for r in results:
        world = r["world"]
        assert world == 4
        assert set(r["experts"]) == {"w1", "w2", "w3"}
        for name, e in r["experts"].items():
            assert e["name"] == f"experts.{name}"
            assert e["global_shape"] == e["full_shape"]
            assert e["placement"] == Shard(0)
            assert e["record_local_shape"] == e["local_shape"] == (NUM_EXPERTS // world, *e["full_shape"][1:])
            # The record alone says where this shard sits in the global tensor.
            torch.testing.assert_close(e["local"], e["full_at_record_slices"], rtol=0, atol=0)
        assert r["router"] == Replicate()
