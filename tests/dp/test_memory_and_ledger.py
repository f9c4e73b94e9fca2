"""Bytes held per rank against the ZeRO paper's accounting, and bytes on the wire per step.

Ψ is the number of parameters. Padding: each parameter's dim 0 is padded to
a multiple of N for ZeRO, so a rank's shard holds up to (N-1) extra rows of
each parameter; the bounds below allow exactly the measured padding
(``pad`` elements over all ranks) and AdamW's per-parameter ``step`` counter
(one float32 scalar each) — nothing else.
"""

import pytest
import torch
import torch.distributed as dist

from polyshard.collectives import CommLedger
from polyshard.dp import DataParallel, FullyShardedDataParallel, MixedPrecision, ZeroOptimizer, bytes_held

from ._helpers import adamw, local_step_loss, make_model

BF16 = MixedPrecision(param_dtype=torch.bfloat16)  # bf16 params and grads, fp32 master + Adam state

# (params, grads, optimizer state) bytes per Ψ from the paper, as functions of N.
PAPER = {
    0: lambda n: (2, 2, 12),  # 16Ψ
    1: lambda n: (2, 2, 12 / n),  # 4Ψ + 12Ψ/N
    2: lambda n: (2, 2 / n, 12 / n),  # 2Ψ + 14Ψ/N
    3: lambda n: (2 / n, 2 / n, 12 / n),  # 16Ψ/N
}


def _wrap(stage: int, mixed_precision=None, group=None):
    group = group or dist.group.WORLD
    model = make_model()
    if stage == 3:
        wrapped = FullyShardedDataParallel(model, group=group, mixed_precision=mixed_precision)
    else:
        wrapped = DataParallel(model, group=group, zero_stage=stage, mixed_precision=mixed_precision)
    return wrapped, ZeroOptimizer(adamw(wrapped.parameters()), wrapped)


def _units(wrapped, stage):
    return wrapped.reduce_order if stage == 3 else wrapped.buckets()


def _padding(wrapped, stage):
    if stage == 0:
        return 0
    return sum(u.layout.padding_numel for u in _units(wrapped, stage))


def _flag_bytes(wrapped, stage, itemsize=4):
    """Gradient reductions carry one presence flag per parameter in every rank's row (float32 here)."""
    return itemsize * sum(u.layout.n * len(u.params) for u in _units(wrapped, stage))


def _measure(stage: int):
    n = dist.get_world_size()
    wrapped, opt = _wrap(stage, BF16)
    local_step_loss(wrapped, 0, 1, dist.group.WORLD)
    opt.step()  # state exists now; gradients are still held (no zero_grad yet)
    report = bytes_held(wrapped, opt)
    psi = sum(p.numel() for p in wrapped.parameters())
    pad = _padding(wrapped, stage)
    num_params = len(list(wrapped.parameters()))
    per_psi = PAPER[stage](n)
    for measured, factor, extra, what in zip(
        (report.params, report.grads, report.optimizer_state),
        per_psi,
        # Gradients: the presence flags; AdamW keeps one float32 `step` scalar per parameter.
        (0, _flag_bytes(wrapped, stage), 4 * num_params),
        ("params", "grads", "optimizer state"),
    ):
        low = factor * psi
        high = factor * (psi + pad) + extra
        assert low <= measured <= high, f"stage {stage} {what}: {measured} B not in [{low}, {high}] (Ψ={psi}, N={n})"
    return report.total, psi


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_held_match_zero_paper(distributed, world_size):
    for stage in range(4):
        totals = distributed.run(world_size, _measure, stage)
        assert len({t for t, _ in totals}) == 1  # every rank holds the same amount


def _wire_per_step(stage: int):
    wrapped, opt = _wrap(stage)  # float32 params and grads: 4 bytes each
    psi_bytes = 4 * sum(p.numel() for p in wrapped.parameters())
    padded_bytes = psi_bytes + 4 * _padding(wrapped, stage)
    flags = _flag_bytes(wrapped, stage)  # travel with the gradients, not with the parameters
    with CommLedger() as ledger:
        local_step_loss(wrapped, 0, 1, None)
        opt.step()
    return {
        "psi_bytes": psi_bytes,
        "padded_bytes": padded_bytes,
        "flags": flags,
        "all_gather": ledger.total("all_gather"),
        "reduce_scatter": ledger.total("reduce_scatter"),
        "wire": ledger.wire(),  # the test's own loss all-reduce bypasses the ledger (plain dist)
        "calls": {op: ledger.calls(op) for op in ("all_reduce", "all_gather", "reduce_scatter")},
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_ledger_bytes_per_step(distributed, world_size):
    n = world_size
    for stage in range(4):
        results = distributed.run(world_size, _wire_per_step, stage)
        assert len(results) == world_size
        for r in results:
            psi_bytes, padded_bytes, flags = r["psi_bytes"], r["padded_bytes"], r["flags"]
            if stage == 3:
                # Two all-gathers (forward, backward) and one reduce-scatter of every parameter.
                assert r["all_gather"] == 2 * padded_bytes
                assert r["reduce_scatter"] == padded_bytes + flags
                assert 3 * psi_bytes <= r["all_gather"] + r["reduce_scatter"] <= 3 * padded_bytes + flags
                continue
            wire = r["wire"]
            # Plain DP: one all-reduce of the gradients. ZeRO-1/2: reduce-scatter of the
            # gradients plus all-gather of the parameters, the same 2(N-1)/N volume.
            assert 2 * (n - 1) / n * psi_bytes <= wire + 1e-6
            assert wire <= 2 * (n - 1) / n * (padded_bytes + flags) + 1e-6
            if stage == 0:
                assert r["calls"]["all_gather"] == 0 and r["calls"]["reduce_scatter"] == 0
            else:
                assert r["calls"]["all_reduce"] == 0
