"""The executor on processes: stored activations, memory per stage, the backward hook,
communication volume, the timeline, and bad input."""

import contextlib
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import CommLedger
from polyshard.pp import (
    Action,
    DeadlockError,
    Kind,
    PipelineExecutor,
    Schedule,
    StageShapeError,
    build_stages,
    gather_timeline,
    make_schedule,
    simulate,
)
from tests.pp import models


def _run_step(name, m, virtual_stages=None, backward_context=None, builders=None):
    p, rank = dist.get_world_size(), dist.get_rank()
    schedule = make_schedule(name, p, m, virtual_stages)
    stages = build_stages(builders or models.builders(), schedule.num_stages, schedule.stages_of(rank))
    executor = PipelineExecutor(stages, schedule, models.loss_fn, backward_context=backward_context)
    x, y = models.batch(0, 2 * m)
    last = schedule.num_stages - 1 in stages
    return schedule, stages, executor.step(x if 0 in stages else None, y if last else None)


def _stored_activations(name, m):
    schedule, _, result = _run_step(name, m)
    return result.peak_activations, simulate(schedule).peak_activations[dist.get_rank()]


def test_v_schedules_store_what_the_simulator_predicts(distributed):
    for name in ("zb-v", "dualpipev"):
        results = distributed.run(2, _stored_activations, name, 5)
        assert [r[0] for r in results] == [r[1] for r in results] == ([4, 4] if name == "zb-v" else [5, 5])


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_stored_activations_at_peak(distributed, name):
    p, m = 4, 9  # m = 2p + 1
    results = distributed.run(p, _stored_activations, name, m)
    measured = [r[0] for r in results]
    assert measured[0] == (m if name == "gpipe" else p)
    assert measured == [r[1] for r in results]  # every rank matches the simulator's prediction


def _stage_memory():
    p, rank = dist.get_world_size(), dist.get_rank()
    real_builds = []

    def builder(i, build):
        if torch.empty(0).device.type != "meta":  # parameter counting builds on the meta device
            real_builds.append(i)
        return build()

    builders = [lambda i=i, b=b: builder(i, b) for i, b in enumerate(models.builders())]
    stages = build_stages(builders, p, [rank])
    return sum(q.numel() * q.element_size() for q in stages[rank].parameters()), real_builds


def test_rank_builds_only_its_stage(distributed):
    p = 4
    results = distributed.run(p, _stage_memory)
    full = sum(q.numel() * q.element_size() for q in models.reference().parameters())
    # eight equal layers over four ranks: exactly a quarter each
    assert [r[0] for r in results] == [full // p] * p
    for rank, (_, real_builds) in enumerate(results):
        assert real_builds == [2 * rank, 2 * rank + 1]  # only this rank's layers were ever materialised


def _hook_entries(name, m, virtual_stages):
    entries = []

    @contextlib.contextmanager
    def no_sync():
        entries.append(1)
        yield

    schedule, stages, _ = _run_step(name, m, virtual_stages, backward_context=no_sync)
    # one weight-gradient action per (stage, microbatch); the hook skips only the last
    return len(entries), len(stages) * m - 1


@pytest.mark.parametrize(
    ("name", "virtual_stages"), [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 2), ("dualpipev", 2)]
)
def test_backward_context_wraps_all_but_last_backward(distributed, name, virtual_stages):
    for entered, expected in distributed.run(2, _hook_entries, name, 4, virtual_stages):
        assert entered == expected


def _grad_hook_fires(name, m):
    # A data-parallel reducer learns that a gradient is ready from post-accumulate-grad hooks;
    # the zero-bubble W action must fire them just like an unsplit backward.
    p, rank = dist.get_world_size(), dist.get_rank()
    schedule = make_schedule(name, p, m)
    stages = build_stages(models.builders(), schedule.num_stages, schedule.stages_of(rank))
    fired = []  # (W of a split backward and an unsplit B both accumulate; DualPipeV mixes the two)
    for stage in stages.values():
        for param in stage.parameters():
            param.register_post_accumulate_grad_hook(lambda q: fired.append(q))
    x, y = models.batch(0, 2 * m)
    executor = PipelineExecutor(stages, schedule, models.loss_fn)
    executor.step(x if 0 in stages else None, y if schedule.num_stages - 1 in stages else None)
    num_params = sum(1 for stage in stages.values() for _ in stage.parameters())
    return len(fired), num_params * m


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "dualpipev"])
def test_weight_gradients_fire_accumulate_hooks(distributed, name):
    for fired, expected in distributed.run(2, _grad_hook_fires, name, 4):
        assert fired == expected  # once per parameter per microbatch


def _ledger(m):
    with CommLedger() as ledger:
        _run_step("1f1b", m)
    return ledger.calls("send"), ledger.total("send"), ledger.calls("recv")


def test_p2p_volume(distributed):
    m = 3
    microbatch_bytes = 2 * models.HIDDEN * 4  # (2, H) float32 activations and gradients
    rank0, rank1 = distributed.run(2, _ledger, m)
    # shape inference sends one int64 header of 11 values from rank 0 to rank 1 on the first step
    assert rank0 == (m + 1, m * microbatch_bytes + 11 * 8, m)  # activations out, gradients in
    assert rank1 == (m, m * microbatch_bytes, m + 1)  # gradients out, activations (+ header) in


def _timeline(name, m, virtual_stages):
    schedule, _, result = _run_step(name, m, virtual_stages)
    whole = gather_timeline(result.timeline, schedule)
    compute = [s for s in whole.spans if s.kind not in ("X", "R")]  # not posting or waiting
    ordered = True
    for rank in range(whole.num_ranks):
        spans = [s for s in whole.spans if s.rank == rank]
        ordered &= all(a.start <= a.end <= b.start for a, b in zip(spans, spans[1:]))
    return len(compute), sum(len(a) for a in schedule.actions), ordered, whole


def test_timeline_text_and_svg(distributed, tmp_path):
    results = distributed.run(2, _timeline, "interleaved", 4, 2)
    for compute, expected, ordered, _ in results:
        assert compute == expected and ordered  # every action timed once, in order, without overlap
    whole = results[0][3]
    assert 0.0 <= whole.bubble_fraction < 1.0
    for rank in range(2):  # every moment of the step is compute, posting, waiting or something else
        parts = whole.breakdown(rank)
        assert min(parts.values()) >= 0 and abs(sum(parts.values()) - whole.total_time) < 1e-9
    predicted = simulate(make_schedule("interleaved", 2, 4, 2)).bubble_fraction
    text = whole.render_text(80, predicted_bubble=predicted)
    # one row per rank and the bubble line; on tiny stages most time is p2p posting (^) and waiting
    # (~) and some compute spans share a cell, so only check that forwards and backwards of both ranks
    # show up
    rows = text.splitlines()
    assert len(rows) == 3 and all("F" in row[9:] and "B" in row[9:] for row in rows[:2])
    assert text.endswith(f"bubble measured {whole.bubble_fraction:.3f} | simulator {predicted:.3f}")
    svg = whole.to_svg(title="interleaved p=2 m=4 v=2", predicted_bubble=predicted)
    assert f"simulator {predicted:.3f}" in svg
    ET.fromstring(svg)  # well-formed XML
    assert svg.count("<rect") >= len(whole.spans)


def _shape_mismatch():
    builders = models.builders()
    builders[4] = lambda: nn.Linear(2 * models.HIDDEN, models.HIDDEN)  # stage 1 expects width 32, gets 16
    try:
        _run_step("1f1b", 2, builders=builders)
    except Exception as err:
        return type(err).__name__, str(err), getattr(err, "__notes__", [])
    return None


def test_mismatched_stage_shapes_name_rank_and_action(distributed):
    (kind0, text0, _), (kind1, text1, notes1) = distributed.run(2, _shape_mismatch)
    # The failing rank raises the layer's own error, noted with where it happened and what came in.
    assert kind1 == "RuntimeError" and "shapes cannot be multiplied" in text1
    assert notes1[0].startswith("raised in stage 1 at rank 1, action 1F0")
    assert "on the output of stage 0 (shape (2, 16)" in notes1[0]
    assert kind0 == "StageShapeError" and "pipeline rank 1 failed in its stage's first forward" in text0


class _ReturnsTuple(models.Layer):
    """A layer like the others (same parameters, so the partition is unchanged) that returns a tuple."""

    def forward(self, x):
        y = super().forward(x)
        return y, y


def _non_tensor_stage():
    builders = models.builders()
    builders[3] = lambda: _ReturnsTuple(3, models.HIDDEN)  # the last layer of stage 0 returns a tuple
    try:
        _run_step("1f1b", 2, builders=builders)
    except StageShapeError as err:
        return str(err)
    return None


def test_a_stage_returning_a_non_tensor_fails_every_rank(distributed):
    # The failing rank must tell its neighbour, which would otherwise wait for a header forever.
    messages = distributed.run(2, _non_tensor_stage, timeout_s=60)
    assert all(m is not None for m in messages)  # every rank raised StageShapeError, none hung
    assert sum("tuple" in m for m in messages) == 1  # the failing rank says what went wrong
    assert sum("failed in its stage's first forward" in m for m in messages) == 1


class _Broken(models.Layer):
    """A layer with a bug (not a shape problem) in its forward."""

    def forward(self, x):
        raise KeyError("a bug inside the layer")


def _failing_first_stage():
    builders = models.builders()
    builders[1] = lambda: _Broken(1, models.HIDDEN)  # inside stage 0
    try:
        _run_step("1f1b", 2, builders=builders)
    except Exception as err:
        return type(err).__name__, getattr(err, "__notes__", [])
    return None


def test_a_bug_in_a_stage_is_raised_as_itself(distributed):
    # Before: rank 0 reported "stage 0 cannot take the output of stage -1", a shape error hiding the cause.
    (kind0, notes0), (kind1, _) = distributed.run(2, _failing_first_stage, timeout_s=60)
    assert kind0 == "KeyError" and notes0 == [
        "raised in stage 0 at rank 0, action 0F0 (the pipeline's first forward, which infers shapes)"
    ]
    assert kind1 == "StageShapeError"  # the neighbour does not hang: it points at rank 0


def _bad_batch():
    schedule = make_schedule("gpipe", 2, 3)
    stages = build_stages(models.builders(), 2, [dist.get_rank()])
    executor = PipelineExecutor(stages, schedule, models.loss_fn)
    x, y = models.batch(0, 4)
    with pytest.raises(StageShapeError, match="batch size 4, not divisible by m=3"):
        executor.step(x, y)


def _deadlocking_executor():
    f, b = Kind.FORWARD, Kind.BACKWARD
    actions = (
        (Action(f, 0, 0), Action(b, 0, 0), Action(f, 0, 1), Action(b, 0, 1)),
        (Action(f, 1, 0), Action(f, 1, 1), Action(b, 1, 0), Action(b, 1, 1)),
    )
    stages = build_stages(models.builders(), 2, [dist.get_rank()])
    with pytest.raises(DeadlockError, match=r"rank 0 waits forever at step 3 \(\(0RB0\)\)"):
        PipelineExecutor(stages, Schedule("custom", 2, 2, 1, actions), models.loss_fn)


def test_bad_batch_and_deadlocking_schedule(distributed):
    distributed.run(2, _bad_batch)
    distributed.run(2, _deadlocking_executor)


def _forward_only(name, m, virtual_stages):
    p, rank = dist.get_world_size(), dist.get_rank()
    schedule = make_schedule(name, p, m, virtual_stages)
    stages = build_stages(models.builders(), schedule.num_stages, schedule.stages_of(rank))
    executor = PipelineExecutor(stages, schedule, models.loss_fn)
    outputs = []
    for size in (3, 0, 2 * m):  # any batch size, even none, and again after the first
        x, _ = models.batch(size, size)
        outputs.append(executor.forward_only(x if 0 in stages else None, lambda y: y.clone()))
    return outputs


@pytest.mark.parametrize(
    "name, world, m, virtual_stages", [("1f1b", 3, 3, 1), ("interleaved", 2, 2, 2), ("dualpipev", 2, 4, 2)]
)
def test_forward_only_runs_any_batch_through_the_stages(distributed, name, world, m, virtual_stages):
    results = distributed.run(world, _forward_only, name, m, virtual_stages)
    reference = models.reference()
    schedule = make_schedule(name, world, m, virtual_stages)
    holder = schedule.rank_of(schedule.num_stages - 1)  # the rank holding the last stage (rank 0 in a V)
    for rank, outputs in enumerate(results):
        if rank != holder:
            assert outputs == [None, None, None]
            continue
        for size, output in zip((3, 0, 2 * m), outputs):
            with torch.no_grad():
                expected = reference(models.batch(size, size)[0])
            torch.testing.assert_close(output, expected, rtol=0, atol=0)  # the same ops on the same numbers
