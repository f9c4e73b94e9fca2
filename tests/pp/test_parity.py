"""Every schedule on several processes equals one process on the full batch.

Each rank builds only its stages; every rank also builds the whole reference
model from the same seeds and runs the full batch through it, so it can
compare its own parameters: the loss, every gradient after each step, and
every parameter after each SGD-with-momentum step.

Combinations (chosen to keep the folder fast): for p in {2, 4} every
schedule with m in {1, p, 2p+1} (interleaved, v=2: m in {p, 2p}, since m must
be a multiple of p); for p=3 (8 layers split 3/3/2, or 6 stages for v=2)
every schedule with m=p and 1F1B with m in {1, 7}.
"""

import pytest
import torch
import torch.distributed as dist

from polyshard.mesh import Mesh, get_placement
from polyshard.pp import PipelineExecutor, build_stages, make_schedule
from tests.pp import models

# float32; the pipeline sums microbatch gradients in a different order than the
# full-batch backward, so results differ by rounding (~1e-7 relative) that three
# momentum steps cannot grow past 1e-5.
TOL = {"rtol": 1e-5, "atol": 1e-6}
STEPS = 3


def _microbatch_counts(name, p):
    return [p, 2 * p] if name == "interleaved" else [1, p, 2 * p + 1]


def _check(name, m, group=None, data_seed=0):
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    schedule = make_schedule(name, p, m, 2 if name == "interleaved" else 1)
    stages = build_stages(models.builders(), schedule.num_stages, schedule.stages_of(rank))
    executor = PipelineExecutor(stages, schedule, models.loss_fn, group)
    ref = models.reference()
    params = [q for stage in stages.values() for q in stage.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    first, last = 0 in stages, schedule.num_stages - 1 in stages
    for step in range(STEPS):
        x, y = models.batch(data_seed + step, 2 * m)
        opt.zero_grad()
        ref_opt.zero_grad()
        result = executor.step(x if first else None, y if last else None)
        ref_loss = models.loss_fn(ref(x), y)
        ref_loss.backward()
        if last:
            torch.testing.assert_close(result.loss, ref_loss.detach(), **TOL)
        else:
            assert result.loss is None
        for q in params:
            torch.testing.assert_close(q.grad, models.reference_param(ref, get_placement(q).name).grad, **TOL)
        opt.step()
        ref_opt.step()
        for q in params:
            torch.testing.assert_close(q, models.reference_param(ref, get_placement(q).name), **TOL)
    return len(params)


def _parity(name, ms):
    return [_check(name, m) for m in ms]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_schedule_matches_single_process(distributed, name, p):
    counts = distributed.run(p, _parity, name, _microbatch_counts(name, p))
    # every layer's weight and bias is held by exactly one rank
    assert [sum(c) for c in zip(*counts)] == [2 * models.NUM_LAYERS] * len(counts[0])


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_three_stages_match_single_process(distributed, name):
    ms = [1, 3, 7] if name == "1f1b" else [3]
    distributed.run(3, _parity, name, ms)


def _on_mesh(name):
    # pp is the outer axis, so the pp groups are [0, 2] and [1, 3]: stage peers are not neighbours in
    # global rank, and each dp replica pipelines its own data.
    mesh = Mesh({"pp": 2, "dp": 2})
    _check(name, 4, mesh.group("pp"), data_seed=100 * mesh.coord("dp"))


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
def test_pipeline_over_a_mesh_axis(distributed, name):
    distributed.run(4, _on_mesh, name)


@pytest.mark.parametrize("name", ["interleaved", "zb-h1"])
def test_one_rank_hands_stages_over_in_memory(distributed, name):
    # p=1: interleaved puts stages 0 and 1 on the same rank, so activations and gradients pass
    # between them without any send or receive
    distributed.run(1, _parity, name, [1, 3])
