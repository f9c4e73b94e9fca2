"""Each autograd collective, forward and backward, against a one-process computation.

Every rank builds the data of *all* ranks from one seed, so it can compute the
single-process answer itself. Values are small integers stored as float32:
sums of them are exact in any order, so comparisons use zero tolerance.
"""

import pytest
import torch
import torch.distributed as dist

from polyshard.collectives import (
    CollectiveError,
    all_gather,
    all_to_all,
    copy_to,
    gather_from,
    reduce_from,
    reduce_scatter,
    scatter_to,
)

EXACT = {"rtol": 0, "atol": 0}  # integer-valued float32: every sum is exact


def _ints(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).float()


def _per_rank(n, shape, seed):
    return [_ints(*shape, seed=seed + r) for r in range(n)]


def _check(op, dim):
    n, r = dist.get_world_size(), dist.get_rank()
    shape = [2, 3, 4]
    shape[dim] = n * 2  # the gathered/scattered dim splits into n pieces of 2
    if op == "copy_to":
        x = _ints(*shape, seed=0).requires_grad_()
        grads = _per_rank(n, shape, seed=100)
        y = copy_to(x)
        torch.testing.assert_close(y, x, **EXACT)
        (y * grads[r]).sum().backward()
        torch.testing.assert_close(x.grad, sum(grads), **EXACT)
    elif op == "reduce_from":
        xs = _per_rank(n, shape, seed=0)
        x = xs[r].clone().requires_grad_()
        g = _ints(*shape, seed=100)
        y = reduce_from(x)
        torch.testing.assert_close(y, sum(xs), **EXACT)
        (y * g).sum().backward()
        torch.testing.assert_close(x.grad, g, **EXACT)
    elif op == "gather_from":
        full, g = _ints(*shape, seed=0), _ints(*shape, seed=100)
        x = full.chunk(n, dim)[r].clone().requires_grad_()
        y = gather_from(x, dim)
        torch.testing.assert_close(y, full, **EXACT)
        (y * g).sum().backward()
        torch.testing.assert_close(x.grad, g.chunk(n, dim)[r], **EXACT)
    elif op == "scatter_to":
        x = _ints(*shape, seed=0).requires_grad_()
        piece_grads = [g.chunk(n, dim)[i] for i, g in enumerate(_per_rank(n, shape, seed=100))]
        y = scatter_to(x, dim)
        torch.testing.assert_close(y, x.chunk(n, dim)[r], **EXACT)
        (y * piece_grads[r]).sum().backward()
        torch.testing.assert_close(x.grad, torch.cat(piece_grads, dim), **EXACT)
    elif op == "reduce_scatter":
        xs = _per_rank(n, shape, seed=0)
        x = xs[r].clone().requires_grad_()
        piece_grads = [g.chunk(n, dim)[i] for i, g in enumerate(_per_rank(n, shape, seed=100))]
        y = reduce_scatter(x, dim)
        torch.testing.assert_close(y, sum(xs).chunk(n, dim)[r], **EXACT)
        (y * piece_grads[r]).sum().backward()
        torch.testing.assert_close(x.grad, torch.cat(piece_grads, dim), **EXACT)
    elif op == "all_gather":
        full = _ints(*shape, seed=0)
        grads = _per_rank(n, shape, seed=100)  # each rank's downstream differs
        x = full.chunk(n, dim)[r].clone().requires_grad_()
        y = all_gather(x, dim)
        torch.testing.assert_close(y, full, **EXACT)
        (y * grads[r]).sum().backward()
        torch.testing.assert_close(x.grad, sum(grads).chunk(n, dim)[r], **EXACT)
    return True


OPS = ["copy_to", "reduce_from", "gather_from", "scatter_to", "reduce_scatter", "all_gather"]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("op", OPS)
def test_collective_forward_backward(distributed, world, op):
    for dim in (0, 1, -1):
        assert distributed.run(world, _check, op, dim) == [True] * world


def _uneven_all_to_all(skewed):
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    # sizes[i][j]: rows rank i sends to rank j; some are zero, and when skewed every row goes to rank 0.
    sizes = torch.randint(0, 4, (n, n), generator=g)
    if skewed:
        sizes = torch.zeros(n, n, dtype=torch.long)
        sizes[:, 0] = 3
    inputs = [_ints(int(sizes[i].sum()), 5, seed=10 + i) for i in range(n)]
    grads_out = [_ints(int(sizes[:, j].sum()), 5, seed=50 + j) for j in range(n)]

    x = inputs[r].clone().requires_grad_()
    y = all_to_all(x, sizes[:, r].tolist(), sizes[r].tolist())
    expected = torch.cat([inputs[i].split(sizes[i].tolist())[r] for i in range(n)])
    torch.testing.assert_close(y, expected, **EXACT)
    (y * grads_out[r]).sum().backward()
    # Row k of my input went to rank j; its gradient is the matching row of rank j's output gradient.
    expected_grad = torch.cat([grads_out[j].split(sizes[:, j].tolist())[r] for j in range(n)])
    torch.testing.assert_close(x.grad, expected_grad, **EXACT)
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("skewed", [False, True])
def test_all_to_all_uneven(distributed, world, skewed):
    assert distributed.run(world, _uneven_all_to_all, skewed) == [True] * world


def _bad_shapes():
    with pytest.raises(CollectiveError, match="does not split evenly over 2 ranks; pad it to a multiple of 2"):
        scatter_to(torch.zeros(3, 4), 0)
    with pytest.raises(CollectiveError, match="does not split evenly"):
        reduce_scatter(torch.zeros(5), 0)
    with pytest.raises(CollectiveError, match="sum to 3 but the tensor has 4 rows"):
        all_to_all(torch.zeros(4, 2), [2, 2], [1, 2])
    with pytest.raises(CollectiveError, match="needs 2 split sizes"):
        all_to_all(torch.zeros(4, 2), [4], [4])
    return True


def test_bad_shapes_are_typed_errors(distributed):
    assert distributed.run(2, _bad_shapes) == [True, True]


def _identity_on_one_rank():
    x = torch.ones(3, requires_grad=True)
    group = dist.new_group([dist.get_rank()])
    return all(f(x, group=group) is x for f in (copy_to, reduce_from)) and gather_from(x, 0, group) is x


def test_groups_of_one_are_identity(distributed):
    assert distributed.run(2, _identity_on_one_rank) == [True, True]
