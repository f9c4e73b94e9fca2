"""Parameters that no rank used, parameters one rank used, weights shared by two blocks, and buffers.

Each worker trains the same model three ways on the same data: on one process
(the full batch), with a polyshard wrapper (its rows) and with PyTorch's DDP
(its rows), and returns the parameters; the parent compares them. AdamW with
weight decay moves every parameter that has a gradient, so a parameter that
should be left alone shows any update at once.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from polyshard.dp import DataParallel, FullyShardedDataParallel, ParamSet, ZeroOptimizer

from ._helpers import adamw

STEPS, ROWS = 6, 8  # rows per rank


class Gated(nn.Module):
    """``extra`` runs only on the rows of data rank 0; ``unused`` never runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(12, 7)
        self.extra = nn.Linear(12, 7)
        self.unused = nn.Linear(12, 7)

    def forward(self, x, extra_rows):
        y = self.body(x)
        if extra_rows:  # the first `extra_rows` rows also pass through `extra`
            y = torch.cat([y[:extra_rows] + self.extra(x[:extra_rows]), y[extra_rows:]])
        return y


def _data(step, n):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS * n, 12, generator=g), torch.randn(ROWS * n, 7, generator=g)


def _reference(n):
    model = Gated()
    opt = adamw(model.parameters())
    for step in range(STEPS):
        x, y = _data(step, n)
        nn.functional.mse_loss(model(x, ROWS), y).backward()  # rank 0's rows are the first ROWS
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _parallel(strategy):
    n, rank = dist.get_world_size(), dist.get_rank()
    model = Gated()
    if strategy == "ddp":
        wrapped = DDP(model, find_unused_parameters=True)
        opt = adamw(wrapped.parameters())
    elif strategy == "zero3":
        # `extra` and `unused` live in the root unit: gathered at every forward on every rank, so the
        # rank that skips `extra` still joins the all-gather its peer needs.
        wrapped = FullyShardedDataParallel(model, group=dist.group.WORLD, blocks=[model.body])
        opt = ZeroOptimizer(adamw(wrapped.parameters()), wrapped)
    else:
        stage = {"dp": 0, "zero1": 1, "zero2": 2}[strategy]
        wrapped = DataParallel(model, group=dist.group.WORLD, zero_stage=stage, bucket_cap_mb=0.0001)
        opt = adamw(wrapped.parameters()) if stage == 0 else ZeroOptimizer(adamw(wrapped.parameters()), wrapped)
    for step in range(STEPS):
        x, y = (t[rank * ROWS : (rank + 1) * ROWS] for t in _data(step, n))
        nn.functional.mse_loss(wrapped(x, ROWS if rank == 0 else 0), y).backward()
        if hasattr(wrapped, "finish_grad_sync"):
            wrapped.finish_grad_sync()
        opt.step()
        opt.zero_grad()
    state = wrapped.full_parameters() if strategy == "zero3" else dict(model.named_parameters())
    return {k: v.detach().clone() for k, v in state.items()}


def _run(strategy):
    return _reference(dist.get_world_size()), _parallel(strategy), _parallel("ddp")


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3"])
def test_a_parameter_no_rank_used_is_left_alone(distributed, strategy):
    # Before: missing gradients were reduced as zeros, so AdamW decayed `unused` (1.2e-2 off after 6 steps).
    initial = {k: v.detach().clone() for k, v in Gated().state_dict().items()}
    for reference, ours, ddp in distributed.run(2, _run, strategy):
        for name in ("unused.weight", "unused.bias"):
            assert torch.equal(ours[name], initial[name])  # bitwise: never stepped
            assert torch.equal(ddp[name], initial[name]) and torch.equal(reference[name], initial[name])
        # `extra` got a gradient from rank 0 only: averaged with rank 1's zeros, as DDP and one process do.
        assert not torch.equal(ours["extra.weight"], initial["extra.weight"])
        for name in reference:
            # float32 sums in another order (the mean of two rank means): a few ulps, kept by AdamW.
            torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours[name], ddp[name], rtol=1e-5, atol=1e-6)


def _two_sets_on_one_group():
    rank = dist.get_rank()
    model, reference = Gated(), Gated()
    del model.unused, reference.unused  # every bucket of the rest completes during backward
    # `extra` in a ParamSet on the very group object the rest uses (as mesh.group("dp") is
    # mesh.group(("dp", "ep")) when ep = 1). Rank 0 launches extra's bucket during backward, before
    # body's; rank 1, which skips `extra`, only at finish_grad_sync: one communicator, two orders.
    extra = ParamSet([model.extra.weight, model.extra.bias], group=dist.group.WORLD)
    wrapped = DataParallel(model, group=dist.group.WORLD, bucket_cap_mb=0.0001, param_sets=[extra])
    x, y = _data(0, 2)
    nn.functional.mse_loss(reference(x, ROWS), y).backward()
    nn.functional.mse_loss(
        wrapped(x[rank * ROWS : (rank + 1) * ROWS], ROWS if rank == 0 else 0), y[rank * ROWS : (rank + 1) * ROWS]
    ).backward()
    wrapped.finish_grad_sync()
    return {n: (p.grad.clone(), reference.get_parameter(n).grad.clone()) for n, p in model.named_parameters()}


def test_param_sets_sharing_a_group_share_one_launch_order(distributed):
    for grads in distributed.run(2, _two_sets_on_one_group, timeout_s=30):
        for name, (ours, expected) in grads.items():
            torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6, msg=name)  # sum order only


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(12, 7)
        self.norm = nn.BatchNorm1d(7)

    def forward(self, x):
        return self.norm(self.fc(x))


def _buffers(use_ddp):
    rank = dist.get_rank()
    model = Normed()
    wrapped = DDP(model) if use_ddp else DataParallel(model, group=dist.group.WORLD)
    opt = adamw(wrapped.parameters())
    for step in range(3):
        x, y = (t[rank * ROWS : (rank + 1) * ROWS] for t in _data(step, dist.get_world_size()))
        nn.functional.mse_loss(wrapped(x), y).backward()
        if not use_ddp:
            wrapped.finish_grad_sync()
        opt.step()
        opt.zero_grad()
    wrapped(x)  # the next forward starts from the first rank's statistics, then adds this rank's batch
    return {k: v.clone() for k, v in model.named_buffers()}


def test_buffers_stay_identical_across_replicas_like_ddp(distributed):
    # Before: each replica kept its own BatchNorm statistics (5e-2 apart after 3 steps).
    ours = distributed.run(2, _buffers, False)
    ddp = distributed.run(2, _buffers, True)
    for rank in range(2):
        for name, value in ours[rank].items():
            torch.testing.assert_close(value, ddp[rank][name], rtol=1e-5, atol=1e-6)  # sum order only
    # Both ranks started the last forward from rank 0's statistics and added different batches.
    assert not torch.equal(ours[0]["norm.running_mean"], ours[1]["norm.running_mean"])


class Tied(nn.Sequential):
    """Three blocks; the last reuses the first one's weight (an embedding tied to the head)."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Linear(8, 8, bias=False), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 8))
        self[2].weight = self[0].weight


def _tied(strategy):
    n, rank = dist.get_world_size(), dist.get_rank()
    models = {}
    for kind in ("reference", strategy):
        model = Tied()
        if kind == "reference":
            wrapped, opt = model, adamw(model.parameters())
        elif kind == "zero3":
            wrapped = FullyShardedDataParallel(model, group=dist.group.WORLD)  # every child is a block
            opt = ZeroOptimizer(adamw(wrapped.parameters()), wrapped)
        else:
            wrapped = DataParallel(model, group=dist.group.WORLD, zero_stage=int(strategy[-1]))
            opt = ZeroOptimizer(adamw(wrapped.parameters()), wrapped)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(ROWS * n, 8, generator=g), torch.randn(ROWS * n, 8, generator=g)
            if kind != "reference":
                x, y = x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS]
            nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad()
        state = wrapped.full_parameters() if kind == "zero3" else dict(model.named_parameters())
        models[kind] = {k: v.detach().clone() for k, v in state.items()}
    return models, strategy == "zero3" and id(wrapped.root.params[0]) == id(model[0].weight)


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_a_weight_shared_by_two_blocks(distributed, strategy):
    # Before: ZeRO-3 gave the shared weight to the first block's unit, which freed it after its
    # forward; the last block then read empty storage.
    for models, in_root in distributed.run(2, _tied, strategy):
        reference, ours = models["reference"], models[strategy]
        assert sorted(ours) == sorted(reference) == ["0.weight", "1.0.bias", "1.0.weight", "2.bias"]
        for name in reference:
            torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-6)  # sum order only
        assert in_root == (strategy == "zero3")  # the root unit encloses both users
