"""A pre-norm transformer block (GQA attention + MLP) under tp, with and without sequence parallelism.

The tp block is the reference block converted by ``parallelize`` (same
numbers), so outputs, the input gradient and every parameter gradient must
match the unconverted block. With SP the block's input and output are this
rank's sequence shard, and the norm weights' gradients are summed by
``sync_sequence_parallel_grads``.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from polyshard.collectives import CommLedger
from polyshard.mesh import Mesh
from polyshard.tp import (
    ColumnParallel,
    ReplicateKVHeads,
    ShardHeads,
    TPEntry,
    parallelize,
    sync_sequence_parallel_grads,
)
from tests.tp.models import Block, assert_dicts_close, block_plan, full_grads

# float32 matmuls and softmax whose partial sums are split over ranks (and
# rearranged by the reduce-scatter): a few ulps, ~1e-7 relative. 1e-5 leaves
# margin; a wrong head mapping or a missing reduction is O(0.1).
TOL = {"rtol": 1e-5, "atol": 1e-5}
B, S = 2, 12  # 12: every tp in {1, 2, 3, 4} splits the sequence
# (hidden, heads, kv heads) that tp divides: 8/4 heads for tp 1, 2, 4; 6/3 heads for tp 3
SHAPES = {1: (32, 8, 4), 2: (32, 8, 4), 3: (24, 6, 3), 4: (32, 8, 4)}


def _setup(sequence_parallel, replicated_kv=False):
    group = Mesh({"tp": dist.get_world_size()}).group("tp")
    hidden, heads, kv_heads = SHAPES[dist.get_world_size(group)]
    plan = block_plan("", sequence_parallel)
    if replicated_kv:  # 2 kv heads on tp=4: each computed on two ranks
        kv_heads = 2
        del plan["attn.[qkv]_proj"]
        plan["attn"] = [TPEntry(sequence_parallel=sequence_parallel), ShardHeads(replicate_kv=True)]
        plan["attn.q_proj"] = ColumnParallel(input_entered=True)
        plan["attn.[kv]_proj"] = ReplicateKVHeads(kv_heads)
    torch.manual_seed(0)
    ref = Block(hidden, heads, kv_heads)
    block = parallelize(copy.deepcopy(ref), tp_group=group, plan=plan)
    x = torch.randn(B, S, hidden, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(B, S, hidden, generator=torch.Generator().manual_seed(2))
    return group, ref, block, x, grad_out


def _mine(t, group, sequence_parallel):
    """This rank's view of a (B, S, H) activation: its sequence shard with SP, all of it without."""
    if not sequence_parallel:
        return t
    return t.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)]


def _parity(sequence_parallel, replicated_kv=False):
    group, ref, block, x, grad_out = _setup(sequence_parallel, replicated_kv)

    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * grad_out).sum().backward()

    x_tp = _mine(x, group, sequence_parallel).clone().requires_grad_()
    out = block(x_tp)
    (out * _mine(grad_out, group, sequence_parallel)).sum().backward()
    synced = sync_sequence_parallel_grads(block, group)
    return {
        "local_heads": block.attn.num_heads,
        "local_kv_heads": block.attn.num_kv_heads,
        "out": (out.detach(), _mine(out_ref, group, sequence_parallel).detach().clone()),
        "synced": synced,
        "x_grad": (x_tp.grad, _mine(x_ref.grad, group, sequence_parallel).clone()),
        "grads": (full_grads(block, group), full_grads(ref, group)),
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_block_parity(distributed, world, sequence_parallel):
    results = distributed.run(world, _parity, sequence_parallel)
    assert len(results) == world
    for r in results:
        assert r["local_heads"] == SHAPES[world][1] // world
        torch.testing.assert_close(*r["out"], **TOL)
        assert r["synced"] == (6 if sequence_parallel else 0)  # 2 norms x (weight, bias) + 2 row-parallel biases
        torch.testing.assert_close(*r["x_grad"], **TOL)
        assert_dicts_close(*r["grads"], **TOL)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_more_tp_ranks_than_kv_heads_replicate_them(distributed, sequence_parallel):
    # Each of the 2 kv heads runs on 2 of the 4 ranks, each rank seeing the gradient of its own two
    # query heads only: the replicated k/v weights' gradients must come out whole (summed over tp).
    results = distributed.run(4, _parity, sequence_parallel, True)
    for r in results:
        assert (r["local_heads"], r["local_kv_heads"]) == (2, 1)
        torch.testing.assert_close(*r["out"], **TOL)
        torch.testing.assert_close(*r["x_grad"], **TOL)
        assert_dicts_close(*r["grads"], **TOL)


def _ledger(sequence_parallel):
    group, _, block, x, grad_out = _setup(sequence_parallel)
    x_tp = _mine(x, group, sequence_parallel).clone().requires_grad_()
    with CommLedger() as fwd:
        out = block(x_tp)
    with CommLedger() as bwd:
        (out * _mine(grad_out, group, sequence_parallel)).sum().backward()
    activation = x.numel() * x.element_size()  # B x S x H float32, per rank
    return {
        phase: {
            op: (ledger.calls(op), ledger.total(op), ledger.wire(op))
            for op in ("all_reduce", "all_gather", "reduce_scatter")
        }
        for phase, ledger in (("fwd", fwd), ("bwd", bwd))
    } | {"activation": activation}


@pytest.mark.parametrize("world", [2, 4])
def test_communication_volume(distributed, world):
    n = world
    plain = distributed.run(world, _ledger, False)[0]
    sp = distributed.run(world, _ledger, True)[0]
    size = plain["activation"]
    for phase in ("fwd", "bwd"):
        # Without SP: row-parallel outputs (fwd) and column-parallel inputs (bwd), 2 per block.
        assert plain[phase]["all_reduce"][:2] == (2, 2 * size)
        assert plain[phase]["all_gather"][0] == plain[phase]["reduce_scatter"][0] == 0
        # With SP: each all-reduce becomes an all-gather + a reduce-scatter of the same buffer.
        assert sp[phase]["all_reduce"][0] == 0
        assert sp[phase]["all_gather"][:2] == (2, 2 * size)
        assert sp[phase]["reduce_scatter"][:2] == (2, 2 * size)
        # Same bytes on the wire per rank: 2(n-1)/n x size either way.
        wire_plain = plain[phase]["all_reduce"][2]
        wire_sp = sp[phase]["all_gather"][2] + sp[phase]["reduce_scatter"][2]
        # approx only for float division in the ledger's ring formula (exact integers otherwise)
        assert wire_plain == pytest.approx(wire_sp) == pytest.approx(2 * 2 * (n - 1) / n * size)
