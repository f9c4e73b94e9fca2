"""bf16 compute with fp32 master weights, gradients reduced in fp32 (or bf16), against one process.

The reference is the same recipe on one process: a bf16 copy of the model
runs forward/backward on the full batch, AdamW steps fp32 masters, and the
masters are rounded back into the bf16 model.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import CommLedger
from polyshard.dp import DataParallel, FullyShardedDataParallel, MixedPrecision, ZeroOptimizer

from ._helpers import STEPS, adamw, batch, local_step_loss, make_model

# Gradients: each rank's bf16 gradient carries bf16 rounding (8-bit mantissa,
# 2^-8 ~ 4e-3 relative) that the one-process bf16 gradient rounds
# differently; rtol 2e-2 is a few of those roundings, atol covers elements
# near zero (gradient entries here are ~1e-1 to 1e-2). A missing average (x N)
# is far outside.
GRAD_TOL = {"rtol": 2e-2, "atol": 2e-3}


def _reference():
    model = make_model()
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = adamw(masters)
    grads = []
    for step in range(STEPS):
        x, y = batch(step)
        nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
        for p, master in zip(model.parameters(), masters):
            master.grad = p.grad.float()
        opt.step()
        model.zero_grad()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters):
                p.copy_(master)
    return grads, {n: m.detach() for (n, _), m in zip(model.named_parameters(), masters)}


def _wrap(stage, mixed_precision):
    if stage == 3:
        wrapped = FullyShardedDataParallel(make_model(), group=dist.group.WORLD, mixed_precision=mixed_precision)
    else:
        wrapped = DataParallel(make_model(), group=dist.group.WORLD, zero_stage=stage, mixed_precision=mixed_precision)
    return wrapped, ZeroOptimizer(adamw(wrapped.parameters()), wrapped)


def _check(stage: int):
    rank = dist.get_rank() if stage else 0
    ref_grads, ref_masters = _reference()
    wrapped, opt = _wrap(stage, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert all(p.dtype == torch.bfloat16 for p in wrapped.parameters())
    named = list(wrapped.module.named_parameters())
    master_of = {n: opt.masters[id(p)] for n, p in named}
    assert all(m.dtype == torch.float32 for m in master_of.values())
    for step in range(STEPS):
        local_step_loss(wrapped, step, 1, dist.group.WORLD)
        wrapped.finish_grad_sync()
        for name, p in named:
            grad = wrapped.grad_shard(p)
            assert grad.dtype == torch.float32  # reduced in fp32
            expected = wrapped.shard_spec(p).shard_of(ref_grads[step][name], rank)
            torch.testing.assert_close(grad, expected, **GRAD_TOL, msg=f"{name} step {step}")
        opt.step()
        opt.zero_grad()
    diffs = []
    for name, master in master_of.items():
        expected = wrapped.shard_spec(dict(named)[name]).shard_of(ref_masters[name], rank)
        diffs.append((master - expected).abs().flatten())
    diffs = torch.cat(diffs)
    return float(diffs.max()), float(diffs.mean())


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_compute_fp32_masters_match_one_process(distributed, stage):
    for max_diff, mean_diff in distributed.run(2, _check, stage):
        # AdamW moves each weight by about lr = 1e-2 per step whatever the gradient's
        # size, so one step taken in the wrong direction would leave a 2e-2 gap.
        # bf16 gradient noise only nudges the step sizes: we measured max ~5e-4,
        # mean ~4e-5 after 5 steps; the bounds leave 10x headroom and stay 4x
        # below a single reversed step.
        assert max_diff <= 5e-3
        assert mean_diff <= 5e-4


def _reduce_bytes(reduce_dtype):
    wrapped, opt = _wrap(2, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
    with CommLedger() as ledger:
        local_step_loss(wrapped, 0, 1, dist.group.WORLD)
        opt.step()
    flags = sum(b.layout.n * len(b.params) for b in wrapped.buckets())  # one presence flag per parameter and row
    return ledger.total("reduce_scatter"), ledger.total("all_gather"), flags


def test_reduce_dtype_sets_gradient_bytes(distributed):
    (fp32_rs, fp32_ag, flags), _ = distributed.run(2, _reduce_bytes, torch.float32)
    (bf16_rs, bf16_ag, _), _ = distributed.run(2, _reduce_bytes, None)
    assert fp32_rs == 2 * bf16_rs  # gradients (and their flags) travel as fp32 when asked, bf16 otherwise
    assert fp32_ag == bf16_ag == bf16_rs - 2 * flags  # parameters always travel in bf16


def _frozen_layer(stage: int):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 2))
    bf16 = MixedPrecision(param_dtype=torch.bfloat16)
    if stage == 3:
        model = FullyShardedDataParallel(net, group=dist.group.WORLD, mixed_precision=bf16)
    else:
        model = DataParallel(net, group=dist.group.WORLD, zero_stage=stage, mixed_precision=bf16)
    opt = ZeroOptimizer(adamw(model.parameters()), model)

    def frozen() -> torch.Tensor:  # ZeRO-3 shards the frozen layer too: gather it
        return model.full_parameters()["0.weight"] if stage == 3 else net[0].weight.detach().clone()

    before = frozen()
    model(torch.randn(3, 4)).float().sum().backward()
    opt.step()
    assert net[0].weight.dtype == torch.bfloat16  # frozen layers compute in bf16 with the rest
    assert net[0].weight.grad is None and torch.equal(frozen(), before)
    return len(opt.masters)


@pytest.mark.parametrize("stage", [0, 3])
def test_frozen_layers_are_cast_and_left_alone(distributed, stage):
    assert distributed.run(2, _frozen_layer, stage) == [2, 2]  # masters only for the trainable weight and bias
