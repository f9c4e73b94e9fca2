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

from .._errors import assert_caught, caught

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
        y_expected = x
        (y * grads[r]).sum().backward()
        grad_expected = sum(grads)
    elif op == "reduce_from":
        xs = _per_rank(n, shape, seed=0)
        x = xs[r].clone().requires_grad_()
        g = _ints(*shape, seed=100)
        y = reduce_from(x)
        y_expected = sum(xs)
        (y * g).sum().backward()
        grad_expected = g
    elif op == "gather_from":
        full, g = _ints(*shape, seed=0), _ints(*shape, seed=100)
        x = full.chunk(n, dim)[r].clone().requires_grad_()
        y = gather_from(x, dim)
        y_expected = full
        (y * g).sum().backward()
        grad_expected = g.chunk(n, dim)[r]
    elif op == "scatter_to":
        x = _ints(*shape, seed=0).requires_grad_()
        piece_grads = [g.chunk(n, dim)[i] for i, g in enumerate(_per_rank(n, shape, seed=100))]
        y = scatter_to(x, dim)
        y_expected = x.chunk(n, dim)[r]
        (y * piece_grads[r]).sum().backward()
        grad_expected = torch.cat(piece_grads, dim)
    elif op == "reduce_scatter":
        xs = _per_rank(n, shape, seed=0)
        x = xs[r].clone().requires_grad_()
        piece_grads = [g.chunk(n, dim)[i] for i, g in enumerate(_per_rank(n, shape, seed=100))]
        y = reduce_scatter(x, dim)
        y_expected = sum(xs).chunk(n, dim)[r]
        (y * piece_grads[r]).sum().backward()
        grad_expected = torch.cat(piece_grads, dim)
    elif op == "all_gather":
        full = _ints(*shape, seed=0)
        grads = _per_rank(n, shape, seed=100)  # each rank's downstream differs
        x = full.chunk(n, dim)[r].clone().requires_grad_()
        y = all_gather(x, dim)
        y_expected = full
        (y * grads[r]).sum().backward()
        grad_expected = sum(grads).chunk(n, dim)[r]
    else:
        raise ValueError(f"unknown op {op!r}")
    observed = {"y": y, "y_expected": y_expected, "grad": x.grad, "grad_expected": grad_expected}
    return {name: t.detach().clone() for name, t in observed.items()}


OPS = ["copy_to", "reduce_from", "gather_from", "scatter_to", "reduce_scatter", "all_gather"]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("op", OPS)
def test_collective_forward_backward(distributed, world, op):
    for dim in (0, 1, -1):
        results = distributed.run(world, _check, op, dim)
        assert len(results) == world
        for rank, r in enumerate(results):
            where = f"{op} dim={dim} rank={rank}"
            torch.testing.assert_close(r["y"], r["y_expected"], **EXACT, msg=lambda m, w=where: f"{w}: {m}")
            torch.testing.assert_close(r["grad"], r["grad_expected"], **EXACT, msg=lambda m, w=where: f"{w} grad: {m}")


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
    (y * grads_out[r]).sum().backward()
    # Row k of my input went to rank j; its gradient is the matching row of rank j's output gradient.
    expected_grad = torch.cat([grads_out[j].split(sizes[:, j].tolist())[r] for j in range(n)])
    return y.detach(), expected, x.grad.clone(), expected_grad


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("skewed", [False, True])
def test_all_to_all_uneven(distributed, world, skewed):
    results = distributed.run(world, _uneven_all_to_all, skewed)
    assert len(results) == world
    for y, expected, grad, expected_grad in results:
        torch.testing.assert_close(y, expected, **EXACT)
        torch.testing.assert_close(grad, expected_grad, **EXACT)
    if skewed:  # every row goes to rank 0: 3 from each rank
        assert [len(y) for y, *_ in results] == [3 * world] + [0] * (world - 1)


def _bad_shapes():
    return [
        caught(scatter_to, torch.zeros(3, 4), 0),
        caught(reduce_scatter, torch.zeros(5), 0),
        caught(all_to_all, torch.zeros(4, 2), [2, 2], [1, 2]),
        caught(all_to_all, torch.zeros(4, 2), [4], [4]),
    ]


def test_bad_shapes_are_typed_errors(distributed):
    results = distributed.run(2, _bad_shapes)
    assert len(results) == 2
    for uneven_scatter, uneven_reduce_scatter, wrong_sum, wrong_count in results:
        assert_caught(uneven_scatter, CollectiveError, "does not split evenly over 2 ranks; pad it to a multiple of 2")
        assert_caught(uneven_reduce_scatter, CollectiveError, "does not split evenly")
        assert_caught(wrong_sum, CollectiveError, "sum to 3 but the tensor has 4 rows")
        assert_caught(wrong_count, CollectiveError, "needs 2 split sizes")


def _identity_on_one_rank():
    x = torch.ones(3, requires_grad=True)
    group = dist.new_group([dist.get_rank()])
    outputs = {
        "copy_to": copy_to(x, group=group),
        "reduce_from": reduce_from(x, group=group),
        "gather_from": gather_from(x, 0, group),
    }
    # Object identity cannot cross processes: report it, and the values, for the parent to check.
    return {name: (y is x, y.detach().clone()) for name, y in outputs.items()}


def test_groups_of_one_are_identity(distributed):
    results = distributed.run(2, _identity_on_one_rank)
    assert len(results) == 2
    for per_op in results:
        assert set(per_op) == {"copy_to", "reduce_from", "gather_from"}
        for name, (is_input, value) in per_op.items():
            assert is_input, f"{name} on a group of one returned a new tensor, not its input"
            torch.testing.assert_close(value, torch.ones(3), **EXACT)
