"""Plain DP, ZeRO-1, ZeRO-2 and ZeRO-3 against one process on the full batch.

For dp in {2, 3, 4}, with and without gradient accumulation, every step's
loss and every gradient (or this rank's rows of it, for ZeRO) and the
parameters after 5 AdamW steps must equal the single-process run.
"""

import pytest
import torch
import torch.distributed as dist

from polyshard.dp import DataParallel, FullyShardedDataParallel, ZeroOptimizer

from ._helpers import STEPS, adamw, local_step_loss, make_model, reference_run

# float32 throughout. Each rank averages its rows and the ranks' means are then
# averaged: the same sum in a different order, a few ulps (~1e-7 relative)
# away from the one-process mean. AdamW divides by sqrt(v), so it passes those
# relative errors on without growing them; 5 steps of lr 1e-2 keep them far
# below 1e-5. A missing or doubled average shows up in the gradients at 1e0.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _wrap(strategy: str, group):
    model = make_model()
    if strategy == "dp":
        wrapped = DataParallel(model, group=group, bucket_cap_mb=0.001)  # ~1 KB buckets: several per model
        return wrapped, adamw(wrapped.parameters())
    if strategy in ("zero1", "zero2"):
        wrapped = DataParallel(model, group=group, bucket_cap_mb=0.001, zero_stage=int(strategy[-1]))
    elif strategy == "zero3":
        wrapped = FullyShardedDataParallel(model, group=group)
    else:  # zero3 with a root unit: the first and last layers are not blocks and stay gathered all step
        wrapped = FullyShardedDataParallel(model, group=group, blocks=[model[1]])
    return wrapped, ZeroOptimizer(adamw(wrapped.parameters()), wrapped)


def _grad_rows(wrapped, strategy, name, param):
    """The gradient this rank holds for ``param`` and the matching rows of a full gradient."""
    if strategy == "dp":
        return param.grad, lambda full: full
    rank = dist.get_rank()
    spec = wrapped.shard_spec(param)
    return wrapped.grad_shard(param), lambda full: spec.shard_of(full, rank)


def _final_params(wrapped, strategy):
    if strategy.startswith("zero3"):
        return wrapped.full_parameters()
    return {n: p.detach() for n, p in wrapped.module.named_parameters()}


def _check_parity(strategy: str, accum: int):
    """Every step's loss and held gradient rows, and the final parameters, each with its reference."""
    group = dist.group.WORLD
    ref_losses, ref_grads, ref_params = reference_run()
    wrapped, opt = _wrap(strategy, group)
    named = list(wrapped.module.named_parameters())
    losses, grads = [], []
    for step in range(STEPS):
        loss = local_step_loss(wrapped, step, accum, group)
        losses.append((loss.detach().clone(), ref_losses[step]))
        wrapped.finish_grad_sync()
        for name, param in named:
            held, rows_of = _grad_rows(wrapped, strategy, name, param)
            # Cloned: the optimizer may reuse the gradient's storage in the next step.
            grads.append((step, name, held.detach().clone(), rows_of(ref_grads[step][name]).clone()))
        opt.step()
        opt.zero_grad()
    final = _final_params(wrapped, strategy)
    params = [(name, value.detach().clone(), ref_params[name]) for name, value in final.items()]
    return {"losses": losses, "grads": grads, "params": params}


def _check_all_accums(strategy: str):
    return [_check_parity(strategy, accum) for accum in (1, 2)]


def _assert_parity(per_rank_results, world_size):
    assert len(per_rank_results) == world_size
    names = {name for name, _ in make_model().named_parameters()}
    for per_accum in per_rank_results:
        assert len(per_accum) == 2  # accum 1 and 2
        for result in per_accum:
            assert len(result["losses"]) == STEPS and len(result["grads"]) == STEPS * len(names)
            for loss, ref_loss in result["losses"]:
                torch.testing.assert_close(loss, ref_loss, **TOL)
            for step, name, held, expected in result["grads"]:
                torch.testing.assert_close(held, expected, **TOL, msg=f"grad {name} step {step}")
            assert {name for name, _, _ in result["params"]} == names
            for name, value, ref in result["params"]:
                torch.testing.assert_close(value, ref, **TOL, msg=f"param {name}")


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3"])
def test_matches_single_process(distributed, world_size, strategy):
    _assert_parity(distributed.run(world_size, _check_all_accums, strategy), world_size)


def test_zero3_with_root_unit(distributed):
    _assert_parity(distributed.run(3, _check_all_accums, "zero3_root"), 3)
