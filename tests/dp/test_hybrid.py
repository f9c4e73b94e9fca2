"""Hybrid sharding (HSDP): ZeRO shards inside groups of dp_shard ranks, replicas across them.

dp = 4 laid out as dp_replicate 2 x dp_shard 2 (shard groups [0, 1] [2, 3],
replica groups [0, 2] [1, 3]). Checked against one process (every loss, each
rank's gradient rows, the parameters after 5 AdamW steps), against the bytes
the ZeRO formulas give for N = dp_shard, against the ledger (reduce-scatter
and all-gather inside the shard group, all-reduce across the replicas), and
against FSDP2's HSDP (``fully_shard`` on a 2-D DeviceMesh), which runs on gloo.
"""

import pytest
import torch
import torch.distributed as dist

from polyshard.collectives import CommLedger
from polyshard.collectives.ledger import group_ranks
from polyshard.dp import DataParallel, DataParallelError, FullyShardedDataParallel, ZeroOptimizer, bytes_held
from polyshard.mesh import Mesh, get_placement

from ._helpers import STEPS, adamw, batch, local_rows, local_step_loss, make_model, reference_run
from .test_memory_and_ledger import _flag_bytes, _padding, held_exactly
from .test_parity import TOL


def _mesh(shard: int) -> Mesh:
    """The dp_replicate x dp_shard mesh of this task (the pool frees its groups after each task)."""
    return Mesh({"dp_replicate": dist.get_world_size() // shard, "dp_shard": shard})


def _wrap(stage: int, mesh: Mesh):
    model = make_model()
    groups = {"group": mesh.group("dp_shard"), "replicate_group": mesh.group("dp_replicate")}
    axes = {"axis": "dp_shard", "replicate_axis": "dp_replicate"}
    if stage == 3:
        wrapped = FullyShardedDataParallel(model, **groups, **axes)
    else:  # ~1 KB buckets: several per model, each reduce-scattered and then all-reduced
        wrapped = DataParallel(model, **groups, **axes, zero_stage=stage, bucket_cap_mb=0.001)
    return wrapped, ZeroOptimizer(adamw(wrapped.parameters()), wrapped)


def _check_parity(stage: int, shard: int, accum: int):
    mesh = _mesh(shard)
    ref_losses, ref_grads, ref_params = reference_run()
    wrapped, opt = _wrap(stage, mesh)
    shard_rank = mesh.group_rank("dp_shard")
    out = {"losses": [], "grads": [], "params": []}
    for step in range(STEPS):
        loss = local_step_loss(wrapped, step, accum, dist.group.WORLD)  # data rank = global rank here
        out["losses"].append((loss, ref_losses[step]))
        wrapped.finish_grad_sync()
        for name, p in wrapped.module.named_parameters():
            assert wrapped.shard_group(p) is mesh.group("dp_shard")
            spec = wrapped.shard_spec(p)
            assert spec.n == shard
            expected = spec.shard_of(ref_grads[step][name], shard_rank)
            out["grads"].append((f"{name} step {step}", wrapped.grad_shard(p).clone(), expected))
        opt.step()
        opt.zero_grad()
    final = wrapped.full_parameters() if stage == 3 else dict(wrapped.module.named_parameters())
    out["params"] = [(name, final[name].detach().clone(), ref_params[name]) for name in ref_params]
    records = [get_placement(opt.masters[id(p)]) for p in wrapped.parameters()]
    out["records"] = {r.name: dict(r.placements) for r in records}
    return out


def _assert_parity(results, stage):
    for result in results:
        for loss, ref in result["losses"]:
            torch.testing.assert_close(loss, ref, **TOL)
        for what, held, expected in result["grads"]:
            torch.testing.assert_close(held, expected, **TOL, msg=what)
        for name, value, ref in result["params"]:
            torch.testing.assert_close(value, ref, **TOL, msg=name)
        # The optimizer state is sharded over dp_shard and replicated over dp_replicate.
        for placements in result["records"].values():
            assert {a: p.to_json() for a, p in placements.items()} == {"dp_replicate": "R", "dp_shard": "S(0)"}


@pytest.mark.parametrize("accum", [1, 2])
def test_zero3_hybrid_matches_single_process(distributed, accum):
    _assert_parity(distributed.run(4, _check_parity, 3, 2, accum), 3)


@pytest.mark.long
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("accum", [1, 2])
def test_zero12_hybrid_matches_single_process(distributed, stage, accum):
    _assert_parity(distributed.run(4, _check_parity, stage, 2, accum), stage)


@pytest.mark.long
@pytest.mark.parametrize("stage", [1, 3])
def test_shard_groups_of_one_rank_replicate_everything(distributed, stage):
    # dp_shard = 1: nothing is sharded, every rank all-reduces its whole "shard" across 4 replicas.
    _assert_parity(distributed.run(4, _check_parity, stage, 1, 1), stage)


def _bytes_and_wire(stage: int):
    mesh = _mesh(2)
    wrapped, opt = _wrap(stage, mesh)
    units = wrapped.reduce_order if stage == 3 else wrapped.buckets()
    with CommLedger() as ledger:
        local_step_loss(wrapped, 0, 1, None)
        opt.step()
    report = bytes_held(wrapped, opt)
    params = list(wrapped.parameters())
    psi = sum(p.numel() for p in params)
    return {
        "held": (report.params, report.grads, report.optimizer_state),
        "formula": held_exactly(stage, "fp32", 2, psi, _padding(wrapped, stage), len(params)),
        "padded_bytes": 4 * (psi + _padding(wrapped, stage)),
        "flags": _flag_bytes(wrapped, stage),
        "units": len(units),
        "shard": group_ranks(mesh.group("dp_shard")),
        "replicate": group_ranks(mesh.group("dp_replicate")),
        "entries": {(op, ranks): (e.calls, e.bytes) for (op, ranks), e in ledger.entries.items()},
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_and_ledger_follow_the_shard_group(distributed, stage):
    for r in distributed.run(4, _bytes_and_wire, stage):
        # Bytes held are ZeRO's with N = dp_shard = 2 (not dp = 4): replicas hold the same shard.
        assert r["held"] == r["formula"]
        padded, flags, units = r["padded_bytes"], r["flags"], r["units"]
        gathers = 2 if stage == 3 else 1  # ZeRO-3 gathers in forward and backward; 1-2 after the step
        # Gradients: reduce-scatter of every padded gradient inside the shard group, then an all-reduce of
        # this rank's half of it (and its flags) across the replicas; parameters gathered in the shard group.
        assert r["entries"] == {
            ("reduce_scatter", r["shard"]): (units, padded + flags),
            ("all_reduce", r["replicate"]): (units, (padded + flags) // 2),
            ("all_gather", r["shard"]): (gathers * units, gathers * padded),
        }


def _bad_stage0():
    mesh = _mesh(2)
    try:
        DataParallel(make_model(), group=mesh.group("dp_shard"), replicate_group=mesh.group("dp_replicate"))
    except DataParallelError as err:
        return str(err)
    return None


def test_hybrid_needs_a_zero_stage(distributed):
    for message in distributed.run(4, _bad_stage0):
        assert message is not None and "needs zero_stage 1 or 2" in message


def _against_fsdp2_hsdp():
    """Ours (ZeRO-3, hybrid) and FSDP2's HSDP on the same model and data: losses and final parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(2)
    ours, ours_opt = _wrap(3, mesh)
    peer = make_model()
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in peer:
        fully_shard(block, mesh=device_mesh)  # a 2-D mesh: replicate over dim 0, shard over dim 1 (HSDP)
    fully_shard(peer, mesh=device_mesh)
    peer_opt = adamw(peer.parameters())
    losses = []
    for step in range(STEPS):
        x, y = (local_rows(t, dist.get_rank(), 4) for t in batch(step))
        pair = []
        for model, opt in ((ours, ours_opt), (peer, peer_opt)):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.detach().clone())
        losses.append(pair)
    peer_params = {n: p.full_tensor().detach().clone() for n, p in peer.named_parameters()}
    return losses, ours.full_parameters(), peer_params


def test_equals_fsdp2_hsdp(distributed):
    for losses, ours, peer in distributed.run(4, _against_fsdp2_hsdp):
        for step, (a, b) in enumerate(losses):
            # Each rank's own loss; the two reduce the same gradients in a different order: ulps apart.
            torch.testing.assert_close(a, b, **TOL, msg=f"loss step {step}")
        assert ours.keys() == peer.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], peer[name], **TOL, msg=name)
