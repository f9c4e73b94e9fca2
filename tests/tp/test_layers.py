"""Each tp layer, built directly from a seed, against the unsharded torch layer from the same seed.

Forward outputs, input gradients and every parameter gradient must match for
tp in {1, 2, 3, 4}. Shapes are multiples of 12 so every tp divides them; the
vocabulary (10) needs padding on tp=3 (12) and tp=4 (12).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from polyshard.mesh import Mesh
from polyshard.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, gather_full_state
from tests.tp.models import assert_dicts_close, full_grads

# float32 with partial products summed in a different order per tp size:
# differences are a few ulps (~1e-7 relative); a missing or doubled term would be O(1).
TOL = {"rtol": 1e-5, "atol": 1e-6}
EXACT = {"rtol": 0, "atol": 0}  # slicing and gathering copy numbers; nothing is computed
IN, OUT, VOCAB, B, S = 12, 24, 10, 2, 3


def _inputs(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _observed(layer, ref, group, state, **pairs):
    """What the parent compares: the gathered initial state, named (got, want) pairs and all parameter grads."""
    return {
        "state": state,
        "pairs": {k: (got.detach().clone(), want.detach().clone()) for k, (got, want) in pairs.items()},
        "grads": (full_grads(layer, group), full_grads(ref, group)),
    }


def _column(gather_output):
    group = Mesh({"tp": dist.get_world_size()}).group("tp")
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN, OUT, tp_group=group, gather_output=gather_output)
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT)  # same seed -> the same global weights
    state = (gather_full_state(layer, group), ref.state_dict())

    x = _inputs((B, S, IN), seed=1)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(x_ref)
    grad_out = _inputs(out_ref.shape, seed=2)
    (out_ref * grad_out).sum().backward()
    out = layer(x_tp)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if not gather_output:  # each rank holds OUT/tp features
        out_ref, grad_out = out_ref.chunk(n, -1)[r], grad_out.chunk(n, -1)[r]
    (out * grad_out).sum().backward()
    return _observed(layer, ref, group, state, out=(out, out_ref), x_grad=(x_tp.grad, x_ref.grad))


def _padded_head():
    """A head whose 10 outputs tp=3/4 do not divide: padded to 12, the padding dropped on gather."""
    group = Mesh({"tp": dist.get_world_size()}).group("tp")
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN, VOCAB, tp_group=group, gather_output=True, pad_output=True)
    torch.manual_seed(0)
    ref = nn.Linear(IN, VOCAB)
    state = (gather_full_state(layer, group), ref.state_dict())
    x = _inputs((B, S, IN), seed=1)
    out, out_ref = layer(x), ref(x)
    grad_out = _inputs(out_ref.shape, seed=2)
    (out * grad_out).sum().backward()
    (out_ref * grad_out).sum().backward()
    return _observed(layer, ref, group, state, out=(out, out_ref))


def _row(input_is_parallel):
    group = Mesh({"tp": dist.get_world_size()}).group("tp")
    n, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    layer = RowParallelLinear(OUT, IN, tp_group=group, input_is_parallel=input_is_parallel)
    torch.manual_seed(0)
    ref = nn.Linear(OUT, IN)
    state = (gather_full_state(layer, group), ref.state_dict())

    x = _inputs((B, S, OUT), seed=1)
    x_ref = x.clone().requires_grad_()
    x_tp = (x.chunk(n, -1)[r] if input_is_parallel else x).clone().requires_grad_()
    out_ref = ref(x_ref)
    grad_out = _inputs(out_ref.shape, seed=2)
    (out_ref * grad_out).sum().backward()
    out = layer(x_tp)
    (out * grad_out).sum().backward()
    want_x_grad = x_ref.grad.chunk(n, -1)[r] if input_is_parallel else x_ref.grad
    return _observed(layer, ref, group, state, out=(out, out_ref), x_grad=(x_tp.grad, want_x_grad))


def _embedding(sequence_parallel):
    group = Mesh({"tp": dist.get_world_size()}).group("tp")
    n, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    layer = VocabParallelEmbedding(VOCAB, IN, tp_group=group, sequence_parallel=sequence_parallel)
    torch.manual_seed(0)
    ref = nn.Embedding(VOCAB, IN)
    state = (gather_full_state(layer, group), ref.state_dict())
    # The last rank's rows past the real vocabulary (none without padding).
    padding_rows = layer.weight[VOCAB - layer.vocab_start :].detach().clone() if r == n - 1 else None

    ids = torch.randint(0, VOCAB, (B, 12), generator=torch.Generator().manual_seed(3))  # 12: every tp splits S
    out_ref = ref(ids)
    grad_out = _inputs(out_ref.shape, seed=2)
    (out_ref * grad_out).sum().backward()
    out = layer(ids)
    if sequence_parallel:  # output stays split along the sequence
        out_ref, grad_out = out_ref.chunk(n, 1)[r], grad_out.chunk(n, 1)[r]
    (out * grad_out).sum().backward()
    observed = _observed(layer, ref, group, state, out=(out, out_ref))
    return observed | {"padded_num_embeddings": layer.padded_num_embeddings, "padding_rows": padding_rows}


def _assert_parity(results, world, out_tol=TOL):
    """Each rank: same initial weights (exactly), then output, input gradient and every parameter gradient."""
    assert len(results) == world
    for r in results:
        assert_dicts_close(*r["state"], **EXACT)
        got, want = r["pairs"]["out"]
        torch.testing.assert_close(got, want, **out_tol)
        if "x_grad" in r["pairs"]:
            torch.testing.assert_close(*r["pairs"]["x_grad"], **TOL)
        assert_dicts_close(*r["grads"], **TOL)


WORLDS = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear(distributed, world, gather_output):
    results = distributed.run(world, _column, gather_output)
    _assert_parity(results, world)
    width = OUT if gather_output else OUT // world  # without gathering each rank holds OUT/tp features
    assert all(r["pairs"]["out"][0].shape == (B, S, width) for r in results)


@pytest.mark.parametrize("world", [3, 4])
def test_column_parallel_linear_padded_output(distributed, world):
    results = distributed.run(world, _padded_head)
    for r in results:
        assert r["pairs"]["out"][0].shape == (B, S, VOCAB)
    _assert_parity(results, world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear(distributed, world, input_is_parallel):
    _assert_parity(distributed.run(world, _row, input_is_parallel), world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding(distributed, world, sequence_parallel):
    results = distributed.run(world, _embedding, sequence_parallel)
    _assert_parity(results, world, out_tol=EXACT)  # the output: a lookup plus zeros from the other ranks
    for r in results:
        # Padding rows exist only past the real vocabulary and start at zero.
        padded = r["padded_num_embeddings"]
        assert padded == -(-VOCAB // world) * world
    last = results[-1]["padding_rows"]
    assert last.shape[0] == padded - VOCAB
    assert torch.count_nonzero(last) == 0
