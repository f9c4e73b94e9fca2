"""Silent faults inside a step: a replica whose weights drifted, a NaN on one rank only.

Data-parallel replicas must stay bitwise equal; a checksum all-gathered over the dp group finds the
one that drifted (a faulty device, a missed reduction) and every rank stops naming it. A NaN that
appears on one rank reaches every rank through the loss and gradient-norm all-reduces, so no rank
updates its weights: they all keep the same, finite values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.models.common.moe import MoEConfig
from polyshard.models.moe_gpt.config import MoEGPTConfig
from polyshard.trainer.config import from_dict


def _config(corpus, **parallel):
    return from_dict(
        {
            "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16},
            "parallel": parallel,
            "training": {"steps": 4, "global_batch_size": 6},
            "eval": {"every": 0},
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


def _drift_one_replica(config, drifted_rank):
    import torch.distributed as dist

    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.errors import ReplicaMismatchError
    from polyshard.trainer.loop import make_loaders, split_batch, train_step
    from polyshard.trainer.loop.integrity import check_replicas

    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    train_data, _ = make_loaders(config, engine.mesh)
    train_step(engine, *split_batch(config, train_data.next_batch()), lr=1e-3)
    check_replicas(engine, 1)  # equal after a real step: no error
    if dist.get_rank() == drifted_rank:
        weight = next(engine.stages[0].parameters())
        with torch.no_grad():  # one bit of one element: the smallest possible drift
            bits = weight.view(torch.int32)
            bits.view(-1)[7] ^= 1
    try:
        check_replicas(engine, 2)
    except ReplicaMismatchError as err:
        return str(err)
    return None


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_replica_that_drifted_is_found_and_named(distributed, corpus, zero_stage):
    errors = distributed.run(3, _drift_one_replica, _config(corpus, dp=3, zero_stage=zero_stage), 2)
    assert all(e is not None and e == errors[0] for e in errors)  # every rank stops at the same check
    assert "step 2" in errors[0] and "rank(s) [2] differ from the other replicas" in errors[0]


@pytest.mark.system
def test_every_rank_stops_when_one_dp_group_drifted(distributed, corpus):
    # dp2 x tp2: only the dp group of tp rank 1 drifts; the other group must stop at the same check
    # (before: it went on into the next collective alone and the job hung).
    errors = distributed.run(4, _drift_one_replica, _config(corpus, dp=2, tp=2), 3)
    assert all(e is not None and e == errors[0] for e in errors)
    assert "ranks [1, 3] disagree with no majority" in errors[0]


def _drift_one_bias(config, drifted_rank):
    import torch.distributed as dist

    from polyshard.models.common.moe import MoELayer
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.errors import ReplicaMismatchError
    from polyshard.trainer.loop import make_loaders, split_batch, train_step
    from polyshard.trainer.loop.integrity import check_replicas

    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    train_data, _ = make_loaders(config, engine.mesh)
    train_step(engine, *split_batch(config, train_data.next_batch()), lr=1e-3)
    check_replicas(engine, 1)  # the bias moved alike on every rank: no error
    if dist.get_rank() == drifted_rank:
        router = next(m for m in engine.stages[0].modules() if isinstance(m, MoELayer)).router
        router.bias.view(torch.int32)[1] ^= 1  # one bit of one expert's bias
    try:
        check_replicas(engine, 2)
    except ReplicaMismatchError as err:
        return str(err)
    return None


def test_a_router_bias_that_drifted_is_found_on_expert_parallel_ranks(distributed, corpus):
    # ep3 alone has no dp replicas of the experts to compare, but the sigmoid router's bias is
    # replicated state on every rank of a stage: a rank whose bias drifted is named.
    config = _config(corpus, ep=3)
    moe = MoEConfig(num_experts=3, top_k=1, score="sigmoid", bias_update_rate=0.01)
    config = dataclasses.replace(config, model=MoEGPTConfig(**{**config.model.__dict__, "kind": "moe-gpt", "moe": moe}))
    errors = distributed.run(3, _drift_one_bias, config, 1)
    assert all(e is not None and e == errors[0] for e in errors)
    assert "step 2" in errors[0] and "rank(s) [1] differ from the other replicas" in errors[0]


def _nan_on_one_rank(config):
    import torch.distributed as dist

    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import make_loaders, split_batch, train_step
    from polyshard.trainer.loop.integrity import weights_finite

    engine = build_engine(config, Mesh(config.parallel.mesh_axes))
    train_data, _ = make_loaders(config, engine.mesh)
    before = _weights(engine)
    stage = engine.stages[0]
    hook = None
    if dist.get_rank() == 1:  # only rank 1's activations turn NaN
        first = next(m for m in stage.modules() if isinstance(m, torch.nn.Embedding))
        hook = first.register_forward_hook(lambda module, args, out: out * float("nan"))
    measured = train_step(engine, *split_batch(config, train_data.next_batch()), lr=1e-3)
    loss, norm = measured.loss, measured.grad_norm
    if hook is not None:
        hook.remove()
    after = _weights(engine)
    unchanged = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    return loss, norm, unchanged, weights_finite(engine)


def _weights(engine) -> dict[str, torch.Tensor]:
    """This rank's weights: its rows under ZeRO-3 (the parameters themselves are freed between steps)."""
    if engine.config.parallel.zero_stage == 3:
        return {n: t.clone() for n, t in engine.wrappers[0].local_shards().items()}
    return {n: p.detach().clone() for n, p in engine.stages[0].named_parameters()}


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_a_nan_on_one_rank_stops_every_rank_from_updating(distributed, corpus, zero_stage):
    results = distributed.run(2, _nan_on_one_rank, _config(corpus, dp=2, zero_stage=zero_stage))
    for loss, norm, unchanged, finite in results:
        assert loss != loss or norm != norm  # NaN: every rank sees the reduced value
        assert unchanged and finite  # no rank stepped; nothing non-finite could be saved
    assert str(results[0][:2]) == str(results[1][:2])  # both ranks agree on the step's numbers
