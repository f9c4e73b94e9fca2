"""Every schedule on several processes equals one process on the full batch.

Each rank builds only its stages; every rank also builds the whole reference
model from the same seeds and runs the full batch through it, so it can
compare its own parameters: the loss, every gradient after each step, and
every parameter after each SGD-with-momentum step.

Combinations (chosen to keep the folder fast): for p in {2, 4} every
schedule with m in {1, p, 2p+1} (interleaved, v=2: m in {p, 2p}, since m must
be a multiple of p; DualPipeV: m in {2p, 2p+1}, since it needs m >= 2p); for
p=3 (8 layers split 3/3/2, or 6 stages for two per rank) every schedule with
m=p (DualPipeV 2p) and 1F1B with m in {1, 7}. ZB-V and DualPipeV put stages r
and 2p-1-r on rank r, so rank 0 holds the first and the last stage.
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


SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"]


def _microbatch_counts(name, p):
    if name == "dualpipev":
        return [2 * p, 2 * p + 1]
    return [p, 2 * p] if name == "interleaved" else [1, p, 2 * p + 1]


def _check(name, m, group=None, data_seed=0, prefetch=None):
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    schedule = make_schedule(name, p, m)  # interleaved: v=2; zb-v, dualpipev: two stages per rank
    stages = build_stages(models.builders(), schedule.num_stages, schedule.stages_of(rank))
    executor = PipelineExecutor(stages, schedule, models.loss_fn, group, prefetch=prefetch)
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


def _parity(name, ms, prefetch=None):
    return [_check(name, m, prefetch=prefetch) for m in ms]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_matches_single_process(distributed, name, p):
    counts = distributed.run(p, _parity, name, _microbatch_counts(name, p))
    # every layer's weight and bias is held by exactly one rank
    assert [sum(c) for c in zip(*counts)] == [2 * models.NUM_LAYERS] * len(counts[0])


@pytest.mark.parametrize("name", SCHEDULES)
def test_three_stages_match_single_process(distributed, name):
    ms = {"1f1b": [1, 3, 7], "dualpipev": [6]}.get(name, [3])
    distributed.run(3, _parity, name, ms)


def _on_mesh(name):
    # pp is the outer axis, so the pp groups are [0, 2] and [1, 3]: stage peers are not neighbours in
    # global rank, and each dp replica pipelines its own data.
    mesh = Mesh({"pp": 2, "dp": 2})
    _check(name, 4, mesh.group("pp"), data_seed=100 * mesh.coord("dp"))


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-v"])
def test_pipeline_over_a_mesh_axis(distributed, name):
    distributed.run(4, _on_mesh, name)


@pytest.mark.parametrize("name", ["interleaved", "zb-h1", "zb-v", "dualpipev"])
def test_one_rank_hands_stages_over_in_memory(distributed, name):
    # p=1: interleaved and the V schedules put stages 0 and 1 on the same rank, so activations and
    # gradients pass between them without any send or receive
    distributed.run(1, _parity, name, [2, 3] if name == "dualpipev" else [1, 3])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_receives_posted_late_or_further_ahead_give_the_same_numbers(distributed, prefetch):
    # the default posts receives one compute action ahead; just before use or two ahead changes only when
    # data moves (and, in a V, how far ahead of the senders' order receives must be posted)
    distributed.run(2, _parity, "dualpipev", [5], prefetch)
