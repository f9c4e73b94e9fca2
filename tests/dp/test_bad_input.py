"""Bad input gives typed errors that say what was wrong and what would work."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from polyshard.dp import (
    DataParallel,
    DataParallelError,
    FullyShardedDataParallel,
    GradSyncError,
    MixedPrecision,
    ParameterMismatchError,
    ParamSet,
    UnownedParameterError,
    ZeroOptimizer,
)

from .._errors import assert_caught, caught
from ._helpers import adamw, make_model


def _wrap_mismatched(kind: str, wrapper: str):
    rank = dist.get_rank()
    if kind == "shape":
        model = nn.Sequential(nn.Linear(8, 4 + rank))  # rank 1 builds a wider layer
    else:
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(1 + rank)])  # rank 1 has one layer more
    cls = DataParallel if wrapper == "dp" else FullyShardedDataParallel
    try:
        cls(model, group=dist.group.WORLD)
    except ParameterMismatchError as err:
        return str(err)
    return None


@pytest.mark.parametrize("wrapper", ["dp", "zero3"])
def test_params_differing_across_ranks(distributed, wrapper):
    messages = distributed.run(2, _wrap_mismatched, "shape", wrapper)
    assert "'0.weight' has shape (4, 8)" in messages[0] and "(5, 8)" in messages[1]
    assert all("same model" in m for m in messages)
    messages = distributed.run(2, _wrap_mismatched, "count", wrapper)
    assert "this rank has 2 tensors to wrap but another rank of the group has 4" in messages[0]


def _foreign_optimizer():
    errors = []
    model = DataParallel(make_model(), group=dist.group.WORLD, zero_stage=1)
    stranger = nn.Parameter(torch.zeros(3, 5))
    for params in (list(model.parameters()) + [stranger], list(model.parameters())[1:]):
        try:
            ZeroOptimizer(adamw(params), model)
        except UnownedParameterError as err:
            errors.append(str(err))
    used = adamw(model.parameters())
    used.step()  # no grads: creates no state, so still accepted...
    used.state[next(iter(model.parameters()))]["exp_avg"] = torch.zeros(1)  # ...unless state exists
    try:
        ZeroOptimizer(used, model)
    except GradSyncError as err:
        errors.append(str(err))
    return errors


def test_optimizer_with_params_the_wrapper_does_not_own(distributed):
    foreign, missing, stepped = distributed.run(2, _foreign_optimizer)[0]
    assert "shape (3, 5)" in foreign and "does not manage" in foreign
    assert "'0.0.weight'" in missing and "does not hold" in missing
    assert "before its first step" in stepped


def _bad_arguments():
    model, group, errors = make_model(), dist.group.WORLD, []
    attempts = [
        lambda: DataParallel(model, group=group, zero_stage=3),
        lambda: DataParallel(model, group=group, bucket_cap_mb=0),
        lambda: DataParallel(model, group=group, param_sets=[ParamSet([nn.Parameter(torch.zeros(2))], group)]),
        lambda: DataParallel(model, group=group, param_sets=[ParamSet([model[0][0].weight], group)] * 2),
        lambda: DataParallel(model, group=group, param_sets=[ParamSet([model[0][0].weight], group, divide_by=0)]),
        lambda: FullyShardedDataParallel(make_model(), group=group, keep_gathered=[nn.Linear(2, 2)]),
    ]
    for attempt in attempts:
        try:
            attempt()
        except DataParallelError as err:
            errors.append(str(err))
    return errors


def test_bad_arguments(distributed):
    stage, cap, stranger, twice, divide, kept = distributed.run(2, _bad_arguments)[0]
    assert "FullyShardedDataParallel" in stage
    assert "bucket_cap_mb=0 must be positive" in cap
    assert "shape (2,) that is not a parameter of the wrapped module" in stranger
    assert "'0.0.weight' is listed in two ParamSets" in twice
    assert "divide_by=0 must be a positive integer" in divide
    assert "keep_gathered names a module that is not one of the blocks" in kept


def _second_backward_without_sync():
    model = DataParallel(make_model(), group=dist.group.WORLD)
    x = torch.randn(4, 12)
    model(x).sum().backward()
    return caught(lambda: model(x).sum().backward())  # the first step's reductions are still pending


def test_second_backward_before_finish_is_an_error(distributed):
    # Without the check the second backward's gradients would be silently replaced by the first's average.
    results = distributed.run(2, _second_backward_without_sync)
    assert len(results) == 2
    for result in results:
        assert_caught(result, GradSyncError, "second backward reached a parameter before finish_grad_sync")


def test_mixed_precision_rejects_non_float_dtypes():
    with pytest.raises(DataParallelError, match="param_dtype=torch.int8 is not a floating dtype"):
        MixedPrecision(param_dtype=torch.int8)


def _one_rank_without_gradients():
    model = DataParallel(make_model(), group=dist.group.WORLD)
    out = model(torch.randn(4, 12))
    if dist.get_rank() == 0:
        out.sum().backward()  # rank 1 runs forward only: its backward produces no gradient
    model.finish_grad_sync()
    return [p.grad.abs().sum().item() if p.grad is not None else None for p in model.parameters()]


def test_a_rank_without_gradients_still_joins_the_reduction(distributed):
    # Rank 1 contributes zeros: both ranks end with half of rank 0's gradient, and nobody hangs.
    rank0, rank1 = distributed.run(2, _one_rank_without_gradients, timeout_s=60)
    assert all(g is not None and g > 0 for g in rank0)
    assert rank0 == pytest.approx(rank1)  # float32 all-reduce: identical bits on both ranks
