"""The planner's communication per step against the byte ledger of a real training step."""

import pytest
import torch

from polyshard.collectives import CommLedger
from polyshard.collectives.ledger import group_ranks
from polyshard.cp import split_context_group
from polyshard.mesh import Mesh
from polyshard.planner.comm import rank_traffic
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.builder import build_engine
from polyshard.trainer.loop import train_step


def _wire_by_group(parallel):
    """(measured, estimated) wire bytes of one training step on this rank, by group of global ranks."""
    parallel = dict(parallel)
    model = {"preset": parallel.pop("preset", "tiny"), "kind": parallel.pop("kind", "gpt")}
    if "capacity" in parallel:  # an MoE's
        model["moe"] = {"capacity_factor": parallel.pop("capacity")}
    if "tie" in parallel:
        model["tie_embeddings"] = parallel.pop("tie")
    training = {"global_batch_size": 8, "loss_chunks": parallel.pop("loss_chunks", 0)}
    config = from_dict({"model": model, "parallel": parallel, "training": training})
    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    tokens = torch.randint(0, 256, (8 // config.parallel.data_ranks, 65))
    train_step(engine, tokens[:, :-1], tokens[:, 1:], 1e-3)  # the first step creates buffers and state
    with CommLedger() as ledger:
        train_step(engine, tokens[:, :-1], tokens[:, 1:], 1e-3)
    measured: dict[tuple[int, ...], float] = {}
    for (_, ranks), entry in ledger.entries.items():
        if entry.wire_bytes:
            measured[ranks] = measured.get(ranks, 0.0) + entry.wire_bytes
    world = tuple(range(mesh.layout.world_size))
    groups = {"world": world, "dp": group_ranks(mesh.group(config.parallel.replica_axes))}
    groups |= {axis: group_ranks(mesh.group(axis)) for axis in ("tp", "pp", "cp")}
    if config.parallel.cp_style == "ulysses+ring":  # the 2-D scheme's all-to-all group and ring
        inner, outer = split_context_group(groups["cp"], config.parallel.cp_ulysses)
        groups["cp_ulysses"] = next(tuple(g) for g in inner if mesh.rank in g)
        groups["cp_ring"] = next(tuple(g) for g in outer if mesh.rank in g)
    if config.parallel.hybrid:  # ZeRO's shard group, and the copies of each shard
        groups["dp_shard"] = group_ranks(mesh.group(config.parallel.shard_axes))
        groups["dp_replicate"] = group_ranks(mesh.group(config.parallel.replicate_axes))
    estimated: dict[tuple[int, ...], float] = {}
    for t in rank_traffic(config, mesh.coord("pp")):
        times = 1 if t.phase == "step" else config.parallel.microbatches
        estimated[groups[t.axis]] = estimated.get(groups[t.axis], 0.0) + t.wire_bytes * times
    return measured, {ranks: wire for ranks, wire in estimated.items() if wire}


LAYOUTS = [
    (2, {"dp": 2}),
    (2, {"dp": 2, "zero_stage": 1}),
    (2, {"dp": 2, "zero_stage": 3, "microbatches": 2}),
    # ZeRO-3 gathers the head (kept gathered from its forward through its backward) and a weight tied
    # within the stage (the root unit) once a microbatch, with the chunked loss too
    (2, {"dp": 2, "zero_stage": 3, "microbatches": 2, "tie": True}),
    (2, {"dp": 2, "zero_stage": 3, "microbatches": 2, "loss_chunks": 2}),
    (4, {"dp": 2, "pp": 2, "zero_stage": 3, "microbatches": 2, "loss_chunks": 2}),  # 1F1B: once per microbatch
    (2, {"tp": 2}),
    (2, {"tp": 2, "sequence_parallel": True}),
    # SwiGLU's gate and up enter the tp region once, as q, k and v do: one all-gather and one reduce-scatter
    # (one all-reduce without SP) for the MLP's input, not one per matrix
    (2, {"tp": 2, "preset": "llama-tiny"}),
    (2, {"tp": 2, "sequence_parallel": True, "preset": "llama-tiny"}),
    (2, {"pp": 2, "microbatches": 4}),
    # a tied embedding and head on the two ends: their gradients summed over pp, as this rank holds them
    # (whole, or its ZeRO rows) with the count of copies that had none
    (2, {"pp": 2, "microbatches": 2, "tie": True}),
    (4, {"dp": 2, "pp": 2, "microbatches": 2, "zero_stage": 1, "tie": True}),
    (4, {"dp": 2, "pp": 2, "microbatches": 2, "zero_stage": 3, "tie": True}),
    (4, {"dp": 2, "tp": 2}),
    # SP with ZeRO: the norms' ZeRO rows, as the optimizer reads them, summed over tp once a step
    (4, {"dp": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 1}),
    (4, {"dp": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 3, "microbatches": 2}),
    (2, {"cp": 2}),
    (2, {"cp": 2, "cp_style": "allgather"}),
    (4, {"cp": 2, "tp": 2, "sequence_parallel": True}),
    # Ulysses: Q, K, V and the output all-to-all'd, forward and backward; on cp 4 Llama's 2 kv heads are
    # each repeated twice before the all-to-all; with tp 2 each rank's 2 heads split over cp 2
    (2, {"cp": 2, "cp_style": "ulysses"}),
    (4, {"cp": 4, "cp_style": "ulysses", "preset": "llama-tiny"}),
    (4, {"cp": 2, "tp": 2, "cp_style": "ulysses"}),
    (4, {"cp": 4, "cp_style": "ulysses+ring", "cp_ulysses": 2}),  # all-to-all over pairs, ring across them
    # hybrid sharding: reduce-scatter and gathers inside dp_shard, the rows all-reduced across dp_replicate
    (4, {"dp": 4, "dp_shard": 2, "zero_stage": 2}),
    (4, {"dp": 4, "dp_shard": 2, "zero_stage": 3, "microbatches": 2}),
    (2, {"dp": 2, "kind": "moe-gpt"}),
    (2, {"cp": 2, "kind": "moe-gpt"}),  # the router's statistics summed over cp; experts' grads over dp x cp
    (2, {"cp": 2, "kind": "moe-gpt", "capacity": 1.0}),  # + the expert choices gathered for the capacity rule
    (2, {"tp": 2, "kind": "moe-gpt"}),  # attention's tp collectives only: the routed experts take none
    # sequence parallelism: each tp rank routes its shard; statistics (and capacity's choices) over tp, the
    # router's and experts' gradients summed over tp
    (2, {"tp": 2, "sequence_parallel": True, "kind": "moe-gpt", "capacity": 1.0}),
]


@pytest.mark.parametrize("world, parallel", LAYOUTS, ids=[str(p) for _, p in LAYOUTS])
def test_estimated_wire_bytes_per_group_equal_the_ledger(distributed, world, parallel):
    for rank, (measured, estimated) in enumerate(distributed.run(world, _wire_by_group, parallel)):
        assert measured == pytest.approx(estimated, rel=1e-12), f"rank {rank}"
