"""Bytes held per rank against the ZeRO paper's accounting, and bytes on the wire per step.

Ψ is the number of parameters. The bytes are pinned exactly: the paper's
bytes per Ψ, each term counted over the elements the tensor really spans,
plus the scalars the paper leaves out, and nothing else:

- padding: each parameter's dim 0 is padded to a multiple of N for ZeRO, so
  every sharded tensor spans Ψ + pad elements over the N ranks (``pad``, the
  layouts' padding); without mixed precision the parameters at stages 1-2 live
  in padded storage too (each rank's rows of it are the optimizer's master);
- gradient reductions carry one presence flag per parameter in every rank's
  row, in the reduce dtype;
- AdamW keeps one float32 ``step`` scalar per parameter.

At N = 2 ZeRO-1 is also measured against DDP + ``ZeroRedundancyOptimizer``
on a model with no padding: both hold 12Ψ, and differ only by those scalars.
"""

from fractions import Fraction as F

import pytest
import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import CommLedger
from polyshard.dp import (
    DataParallel,
    FullyShardedDataParallel,
    MemoryReport,
    MixedPrecision,
    ZeroOptimizer,
    bytes_held,
    storage_bytes,
)

from ._helpers import adamw, local_step_loss, make_model

BF16 = MixedPrecision(param_dtype=torch.bfloat16)  # bf16 params and grads, fp32 master + Adam state

# (params, grads, optimizer state) bytes per Ψ from the paper (1910.02054, 3.1), as functions of N.
PAPER = {
    # Mixed precision: 2-byte params and grads, K = 12 (fp32 master, m, v).
    "bf16": {
        0: lambda n: (F(2), F(2), F(12)),  # 16Ψ
        1: lambda n: (F(2), F(2), F(12, n)),  # 4Ψ + 12Ψ/N
        2: lambda n: (F(2), F(2, n), F(12, n)),  # 2Ψ + 14Ψ/N
        3: lambda n: (F(2, n), F(2, n), F(12, n)),  # 16Ψ/N
    },
    # fp32 throughout: 4-byte params and grads, K = 8 (m, v; the parameters are the masters).
    "fp32": {
        0: lambda n: (F(4), F(4), F(8)),  # 16Ψ
        1: lambda n: (F(4), F(4), F(8, n)),  # 8Ψ + 8Ψ/N (12Ψ at N = 2, as ZeroRedundancyOptimizer)
        2: lambda n: (F(4), F(4, n), F(8, n)),  # 4Ψ + 12Ψ/N
        3: lambda n: (F(4, n), F(4, n), F(8, n)),  # 16Ψ/N
    },
}
GRAD_ITEMSIZE = {"bf16": 2, "fp32": 4}  # the reduce dtype (BF16 reduces in bf16), which the flags share
STEP_BYTES = 4  # AdamW's float32 `step` scalar, one per parameter


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


def held_exactly(stage: int, precision: str, n: int, psi: int, pad: int, count: int) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes one rank holds, from the paper's bytes per Ψ (``count``
    parameters, ``pad`` padding elements over all ranks)."""
    per_params, per_grads, per_state = PAPER[precision][stage](n)
    padded = psi + pad  # what sharded tensors span over all N ranks
    # Full fp32 parameters at stages 1-2 live in padded storage: each rank's rows are its master.
    params_span = padded if stage == 3 or (stage in (1, 2) and precision == "fp32") else psi
    span = psi if stage == 0 else padded
    flags = GRAD_ITEMSIZE[precision] * count * (n if stage == 1 else 1)  # stage 1 keeps every rank's row
    exact = (per_params * params_span, per_grads * span + flags, per_state * span + STEP_BYTES * count)
    assert all(value.denominator == 1 for value in exact)
    return tuple(int(value) for value in exact)


def _measure(stage: int, precision: str):
    n = dist.get_world_size()
    wrapped, opt = _wrap(stage, BF16 if precision == "bf16" else None)
    local_step_loss(wrapped, 0, 1, dist.group.WORLD)
    opt.step()  # state exists now; gradients are still held (no zero_grad yet)
    report = bytes_held(wrapped, opt)
    params = list(wrapped.parameters())
    psi = sum(p.numel() for p in params)
    # Without mixed precision the masters are views of the rows the wrapper keeps, never copies.
    shares = [opt.masters[id(p)].untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in params]
    return report, held_exactly(stage, precision, n, psi, _padding(wrapped, stage), len(params)), shares


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bytes_held_match_zero_paper(distributed, world_size, precision):
    for stage in range(4):
        for report, expected, shares in distributed.run(world_size, _measure, stage, precision):
            measured = (report.params, report.grads, report.optimizer_state)
            assert measured == expected, f"stage {stage} {precision} N={world_size}: (params, grads, state)"
            if stage < 3:  # ZeRO-3's masters are views of its shard, not of the (freed) parameters
                assert all(shares) == (precision == "fp32") and any(shares) == all(shares)


def _balanced_model() -> nn.Sequential:
    """Rows divide by 2 (no padding), and ZeroRedundancyOptimizer's greedy split gives each of 2 ranks
    one weight and one bias: Ψ/2 each."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))


def _train_step(model, opt, finish=None):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    opt.zero_grad()
    nn.functional.mse_loss(model(x), torch.zeros(4, 16)).backward()
    if finish is not None:
        finish()
    opt.step()


def _zero1_and_peer():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ours_model = DataParallel(_balanced_model(), group=dist.group.WORLD, zero_stage=1)
    ours_opt = ZeroOptimizer(adamw(ours_model.parameters()), ours_model)
    _train_step(ours_model, ours_opt)
    ours = bytes_held(ours_model, ours_opt)
    # The peer's gradients are views of DDP's buckets, so counting storages counts the buckets once.
    peer_model = DistributedDataParallel(_balanced_model(), gradient_as_bucket_view=True)
    peer_opt = ZeroRedundancyOptimizer(peer_model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    _train_step(peer_model, peer_opt)
    seen: set[int] = set()
    params = storage_bytes(peer_model.parameters(), seen)
    grads = storage_bytes([p.grad for p in peer_model.parameters()], seen)
    local = peer_opt.optim  # this rank's torch optimizer, over the parameters it owns
    state = [v for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    peer = MemoryReport(params, grads, storage_bytes(state, seen))
    owned = sum(len(g["params"]) for g in local.param_groups)
    return ours, peer, owned, sum(p.numel() for p in ours_model.parameters())


def test_zero1_bytes_equal_zero_redundancy_optimizer(distributed):
    count = 4  # parameters of _balanced_model
    for ours, peer, peer_owned, psi in distributed.run(2, _zero1_and_peer):
        assert ours.params == peer.params == 4 * psi
        # Ours carries one presence flag per parameter in each of the 2 rank rows of its gradient buffer.
        assert ours.grads - 4 * 2 * count == peer.grads == 4 * psi
        # m and v of Ψ/2 rows; AdamW's step scalars: ours for every parameter's rows, the peer's for the
        # parameters this rank owns.
        assert ours.optimizer_state - STEP_BYTES * count == peer.optimizer_state - STEP_BYTES * peer_owned
        assert ours.optimizer_state - STEP_BYTES * count == 8 * psi // 2
        assert held_exactly(1, "fp32", 2, psi, 0, count) == (ours.params, ours.grads, ours.optimizer_state)


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
