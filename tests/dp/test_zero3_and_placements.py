"""ZeRO-3's gather/free lifecycle (prefetch, free after use, re-gather for backward) and the
placement records on sharded parameters and optimizer state."""

import torch
import torch.distributed as dist

from polyshard.dp import DataParallel, FullyShardedDataParallel, ZeroOptimizer
from polyshard.mesh import Replicate, Shard, get_placement, shard_tensor
from tests._bounds import AdamWDrift, reordered_sum

from ._helpers import LR, adamw, batch, local_rows, local_step_loss, make_model


def _lifecycle():
    model = FullyShardedDataParallel(make_model(), group=dist.group.WORLD)
    units, log = model.block_units, []
    for i, block in enumerate(model.module):
        # Registered after the wrapper's own pre-hook, so it sees the state during block i's compute.
        block.register_forward_pre_hook(
            lambda m, a, i=i: log.append(
                ("forward", i, units[i].gathered, i + 1 < len(units) and units[i + 1]._gather is not None)
            )
        )
        gather = units[i].gather
        units[i].gather = lambda i=i, gather=gather: (log.append(("gather", i, torch.is_grad_enabled())), gather())
    opt = ZeroOptimizer(adamw(model.parameters()), model)
    loss = torch.nn.functional.mse_loss(model(torch.randn(4, 12)), torch.randn(4, 7))
    after_forward = [u.gathered for u in units] + [p.untyped_storage().nbytes() for p in model.parameters()]
    loss.backward()
    opt.step()
    after_step = [u.gathered for u in units] + [p.untyped_storage().nbytes() for p in model.parameters()]
    return log, after_forward, after_step


def test_zero3_prefetches_frees_and_regathers(distributed):
    log, after_forward, after_step = distributed.run(2, _lifecycle)[0]
    forwards = [entry for entry in log if entry[0] == "forward"]
    # During block i's forward it is whole and block i+1's all-gather is already in flight.
    assert forwards == [("forward", 0, True, True), ("forward", 1, True, True), ("forward", 2, True, False)]
    assert not any(after_forward) and not any(after_step)  # freed after forward and after backward
    gathers = [entry[1] for entry in log if entry[0] == "gather"]
    # Forward gathers 0, 1, 2; backward gathers 2, 1, 0 again (1 and 0 were prefetched).
    assert gathers[:3] == [0, 1, 2] and sorted(gathers[3:]) == [0, 1, 2] and gathers[3] == 2


def _placements(stage: int):
    n, rank = dist.get_world_size(), dist.get_rank()
    if stage == 3:
        model = FullyShardedDataParallel(make_model(), group=dist.group.WORLD)
    else:
        model = DataParallel(make_model(), group=dist.group.WORLD, zero_stage=stage)
    opt = ZeroOptimizer(adamw(model.parameters()), model)
    local_step_loss(model, 0, 1, dist.group.WORLD)
    opt.step()
    if stage == 3:
        full = model.full_parameters()
    else:
        full = {name: p.detach() for name, p in model.module.named_parameters()}
    masters = {}
    for name, p in model.module.named_parameters():
        master = opt.masters[id(p)]
        record = get_placement(master)
        seen = {"record": record, "master_shape": tuple(master.shape), "param_shape": tuple(p.shape)}
        if stage != 0:
            seen["full_shape"] = tuple(full[name].shape)
            padded = torch.zeros(record.tiled_shape)
            padded[: full[name].shape[0]] = full[name]
            seen["master"] = master.detach().clone()
            seen["expected"] = shard_tensor(padded, record, {"dp": n}, {"dp": rank}).clone()
        seen["state_records"] = [get_placement(v) for v in opt.state[master].values() if v.shape == master.shape]
        masters[name] = seen
    rows_seen = {}
    if stage == 3:
        for name, rows in model.local_shards().items():
            record = get_placement(rows)
            padded = torch.zeros(record.tiled_shape)
            padded[: full[name].shape[0]] = full[name]
            expected = shard_tensor(padded, record, {"dp": n}, {"dp": rank}).clone()
            rows_seen[name] = {"record": record, "rows": rows.detach().clone(), "expected": expected}
    param_placements = [get_placement(p).placement("dp") for p in model.parameters()] if stage != 3 else None
    return {"masters": masters, "rows": rows_seen, "param_placements": param_placements}


def test_placement_records_on_shards_and_optimizer_state(distributed):
    names = {name for name, _ in make_model().named_parameters()}
    for stage in range(4):
        results = distributed.run(3, _placements, stage)
        assert len(results) == 3
        for r in results:
            assert set(r["masters"]) == names
            for name, m in r["masters"].items():
                record = m["record"]
                if stage == 0:
                    assert record.placement("dp") == Replicate() and m["master_shape"] == m["param_shape"]
                else:
                    assert record.name == name and record.global_shape == m["full_shape"]
                    assert record.placement("dp") == Shard(0)
                    # The record alone says which rows of the (padded) stepped tensor this rank's master holds.
                    torch.testing.assert_close(m["expected"], m["master"], rtol=0, atol=0)
                assert len(m["state_records"]) == 2  # exp_avg, exp_avg_sq
                assert all(state_record == record for state_record in m["state_records"])
            if stage == 3:  # the parameters' own rows carry the same records, and hold the stepped values
                assert set(r["rows"]) == names
                for seen in r["rows"].values():
                    assert seen["record"].placement("dp") == Shard(0)
                    # Independent of the optimizer (whose fp32 masters share these rows): the rows must be
                    # this rank's slice, per the record, of the full stepped parameter gathered above:
                    # a copy of the same bits.
                    torch.testing.assert_close(seen["rows"], seen["expected"], rtol=0, atol=0)
            else:
                assert len(r["param_placements"]) == len(names)
                assert all(placement == Replicate() for placement in r["param_placements"])


class _MaybeSkip(torch.nn.Module):
    """Three blocks; the last can be skipped, leaving its prefetched all-gather unused."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(3)])
        self.skip_last = False

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if not (self.skip_last and i == 2):
                x = torch.tanh(block(x))
        return x


def _skipped_prefetch():
    net = _MaybeSkip()
    model = FullyShardedDataParallel(net, group=dist.group.WORLD, blocks=list(net.blocks))
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
    net.skip_last = True
    model(torch.randn(4, 6)).sum().backward()  # block 1's forward prefetched block 2, which never ran
    opt.step()  # steps block 2's rows too (with a zero gradient, SGD leaves them, so change them by hand)
    with torch.no_grad():
        model.block_units[2].local.add_(1.0)
    net.skip_last = False
    gathered = {}
    hook = net.blocks[2].register_forward_pre_hook(
        lambda m, a: gathered.update({n: p.detach().clone() for n, p in m.named_parameters()})
    )
    model(torch.randn(4, 6))
    hook.remove()
    expected = model.full_parameters()
    return {n: (gathered[n], expected[f"blocks.2.{n}"]) for n in gathered}


def test_an_unused_prefetch_does_not_serve_stale_parameters(distributed):
    # Without dropping the unused prefetch, block 2 would compute with its rows from before the update.
    results = distributed.run(2, _skipped_prefetch)
    assert len(results) == 2
    for per_param in results:
        assert set(per_param) == {"weight", "bias"}  # block 2 ran and its parameters were seen
        for name, (gathered, expected) in per_param.items():
            assert torch.equal(gathered, expected), name


def _kept_block(steps: int):
    """The last block kept gathered while a loss term outside the forward reads its weight (as the chunked
    loss reads the head's): per step two microbatches' forwards, then one backward of their sum (GPipe's
    order), on this rank's rows; one process's model takes the same steps on the whole batch."""
    from polyshard.collectives import CommLedger

    n, rank = dist.get_world_size(), dist.get_rank()
    reference, base = make_model(), make_model()
    ref_opt = adamw(reference.parameters())
    # Round-off on the longest chain of float32 sums: the forward's fan-ins with the bias (13, 31, 31), the
    # backward's (7, 30, 30) and the batch's 24 rows, split over ranks and microbatches in another order.
    drift = AdamWDrift(ref_opt, grad_rel=reordered_sum(13 + 31 + 31 + 7 + 30 + 30 + 24))
    model = FullyShardedDataParallel(base, group=dist.group.WORLD, keep_gathered=[base[2]])
    opt = ZeroOptimizer(adamw(model.parameters()), model)

    def loss_of(net, head, x, y):  # the mean over the batch, and a penalty read from the head's weight
        return torch.nn.functional.mse_loss(net(x), y) + 1e-2 * (head.weight**2).sum()

    gathered, gathers = [], []
    for step in range(steps):
        x, y = batch(step)
        ref_loss = sum(loss_of(reference, reference[2][0], xm, ym) for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2
        ref_loss.backward()
        ref_opt.step()
        drift.after_step()
        ref_opt.zero_grad()
        mine = [local_rows(t, rank, n) for t in (x, y)]
        with CommLedger() as ledger:
            # each rank's mean over its rows; the average over ranks of the two halves is the reference's
            losses = [loss_of(model, base[2][0], xm, ym) for xm, ym in zip(mine[0].chunk(2), mine[1].chunk(2))]
            gathered.append(model.block_units[2].gathered)  # after both forwards: still whole
            (sum(losses) / 2).backward()
            opt.step()
        gathers.append(ledger.calls("all_gather"))
        gathered.append(model.block_units[2].gathered)  # after the step: freed
        opt.zero_grad()
    full = model.full_parameters()
    # Each element's drift from the reference in units of its own round-off bound, and the bound's median.
    differences = {
        name: (float(((full[name] - p).abs() / drift.bound[p]).max()), float(drift.bound[p].median()))
        for name, p in reference.named_parameters()
    }
    return gathered, gathers, differences


def test_a_kept_block_stays_gathered_until_its_gradients_are_reduced(distributed):
    # 3 ranks: dims 30 and 7 do not divide by 3, so the padded rows are in every gather and reduction.
    for gathered, gathers, differences in distributed.run(3, _kept_block, 3):
        assert gathered == [True, False] * 3
        # Blocks 0 and 1 are gathered in each forward and again in the backward (2 x 2 + 2); the kept
        # block once, at the first forward; the optimizer step gathers nothing.
        assert gathers == [7] * 3
        # float32 sums over 3 ranks' rows in another order, through 3 AdamW steps: within the round-off
        # bound (tests/_bounds.py) on every element; the bound's median stays a hundred times below one
        # step (lr 1e-2), which a stale or unreduced kept block moves most elements by.
        assert all(ratio <= 1 for ratio, _ in differences.values()), differences
        assert all(median < LR / 100 for _, median in differences.values()), differences
