"""The overlapped column-parallel backward (polyshard.tp.overlap) against the two-node one it replaces.

Both layers start from one seed; the plain one is ``overlap=False`` (enter the region with the
autograd collectives, then ``F.linear``). The overlapped backward runs the same kernels on the same
operands and the same collective on the same buffer, only in another order, so outputs and every
gradient must be equal bit for bit. The one exception is ``overlap_forward_gather``, which splits the
forward matmul into one per sequence shard: a kernel may block a smaller matmul differently, so it
gets the float32 tolerance of the layer tests (a missing or doubled term would be O(1)).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import CommLedger
from polyshard.mesh import Mesh
from polyshard.tp import ColumnParallel, ColumnParallelLinear, PlanError, RowParallelLinear, TPError, parallelize

EXACT = {"rtol": 0, "atol": 0}
# float32: overlapped and plain tp take the same products, the sharded matmul summing fan-ins of 16 and
# 32 in two halves: reordered_sum(16 + 32) ~ 6e-6 relative of O(1) values worst case (tests/_bounds.py),
# within rtol; a half missed or added twice moves outputs by ~5e-1.
TOL = {"rtol": 1e-5, "atol": 1e-6}
IN, HIDDEN, B, S = 16, 32, 2, 8  # S splits over tp=2 (and 4)


def _run(options, sequence_parallel, bias, input_grad):
    """An MLP pair (column then row parallel) from seed 0: output, input gradient, parameter gradients,
    and what the byte ledger saw forward and backward."""
    group = Mesh({"tp": dist.get_world_size()}).group("tp")
    n, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    sp = {"sequence_parallel": sequence_parallel}
    up = ColumnParallelLinear(IN, HIDDEN, tp_group=group, bias=bias, **sp, **options)
    down = RowParallelLinear(HIDDEN, IN, tp_group=group, bias=bias, **sp)
    g = torch.Generator().manual_seed(1)
    x, grad_out = torch.randn(B, S, IN, generator=g), torch.randn(B, S, IN, generator=g)
    if sequence_parallel:  # activations outside the pair are this rank's sequence shard
        x, grad_out = x.chunk(n, 1)[r].clone(), grad_out.chunk(n, 1)[r].clone()
    x.requires_grad_(input_grad)
    with CommLedger() as fwd:
        out = down(torch.nn.functional.gelu(up(x)))
    with CommLedger() as bwd:
        out.backward(grad_out)
    grads = {f"{name}.{p}": t.grad for name, m in (("up", up), ("down", down)) for p, t in m.named_parameters()}
    ops = ("all_reduce", "all_gather", "reduce_scatter")
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": grads,
        "ledger": {
            phase: {op: (led.calls(op), led.total(op)) for op in ops} for phase, led in (("fwd", fwd), ("bwd", bwd))
        },
    }


def _pair(options, sequence_parallel, bias=True, input_grad=True):
    return _run({"overlap": False}, sequence_parallel, bias, input_grad), _run(
        options, sequence_parallel, bias, input_grad
    )


def _assert_same(plain, overlapped, tol):
    torch.testing.assert_close(overlapped["out"], plain["out"], **tol)
    if plain["x_grad"] is None:
        assert overlapped["x_grad"] is None
    else:
        torch.testing.assert_close(overlapped["x_grad"], plain["x_grad"], **tol)
    assert overlapped["grads"].keys() == plain["grads"].keys()
    for name, want in plain["grads"].items():
        torch.testing.assert_close(overlapped["grads"][name], want, msg=lambda m, n=name: f"{n}: {m}", **tol)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_overlapped_backward_equals_plain(distributed, world, sequence_parallel):
    for plain, overlapped in distributed.run(world, _pair, {"overlap": True}, sequence_parallel):
        _assert_same(plain, overlapped, EXACT)
        assert overlapped["ledger"] == plain["ledger"]  # the same collectives, calls and bytes


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_overlap_without_bias_or_input_gradient(distributed, sequence_parallel):
    # The first layer of a model: nothing upstream needs the input gradient, so no sum is posted.
    for plain, overlapped in distributed.run(2, _pair, {}, sequence_parallel, False, False):
        _assert_same(plain, overlapped, EXACT)
        assert overlapped["ledger"] == plain["ledger"]
        assert not any(k.endswith("bias") for k in overlapped["grads"])


def test_regathered_input_equals_plain(distributed):
    # Megatron's memory saving: only the sequence shard is kept, and gathered again in backward.
    for plain, overlapped in distributed.run(2, _pair, {"regather_input": True}, True):
        _assert_same(plain, overlapped, EXACT)
        assert overlapped["ledger"]["fwd"] == plain["ledger"]["fwd"]
        calls, nbytes = plain["ledger"]["bwd"]["all_gather"]
        # One more all-gather backward: the (B, S, IN) float32 input of the column-parallel layer.
        assert overlapped["ledger"]["bwd"]["all_gather"] == (calls + 1, nbytes + B * S * IN * 4)


def test_forward_gather_overlap_matches_plain(distributed):
    for plain, overlapped in distributed.run(2, _pair, {"overlap_forward_gather": True}, True):
        _assert_same(plain, overlapped, TOL)
        assert overlapped["ledger"] == plain["ledger"]


def _bad_options():
    group = Mesh({"tp": dist.get_world_size()}).group("tp")
    seen = {}
    for name, make in {
        "layer": lambda: ColumnParallelLinear(IN, HIDDEN, tp_group=group, regather_input=True),
        "plan": lambda: parallelize(
            nn.Sequential(nn.Linear(IN, HIDDEN)),
            tp_group=group,
            plan={"0": ColumnParallel(overlap_forward_gather=True)},
        ),
    }.items():
        try:
            make()
        except TPError as err:
            seen[name] = (type(err), str(err))
    return seen


def test_sequence_parallel_options_need_sequence_parallel(distributed):
    seen = distributed.run(2, _bad_options)[0]
    assert seen["layer"][0] is TPError and "sequence_parallel=True" in seen["layer"][1]
    assert seen["plan"][0] is PlanError and "'0'" in seen["plan"][1]
