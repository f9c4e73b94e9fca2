"""Schedules through the tensor-free simulator: no deadlock, and the textbook figures.

Costs F = B = W = 1 (an unsplit backward costs B + W = 2). The formulas are
exact for these costs with free communication, so the checks use 1e-9, which
only absorbs float rounding of the sums.
"""

import pytest

from polyshard.pp import (
    Action,
    DeadlockError,
    Schedule,
    ScheduleError,
    Span,
    Timeline,
    format_program,
    make_schedule,
    measured_costs,
    simulate,
)

EXACT = 1e-9  # float rounding of sums of small integers and one division
SIZES = [(p, m) for p in range(1, 9) for m in range(1, 17)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_and_peak(name):
    for p, m in SIZES:
        result = simulate(make_schedule(name, p, m))
        assert abs(result.bubble_fraction - (p - 1) / (m + p - 1)) < EXACT, (p, m)
        assert result.total_time == 3 * (m + p - 1)
        expected_peak = [m] * p if name == "gpipe" else [min(p - s, m) for s in range(p)]
        assert list(result.peak_activations) == expected_peak, (p, m)


@pytest.mark.parametrize("virtual_stages", [2, 3])
def test_interleaved_bubble(virtual_stages):
    for p, m in SIZES:
        if m % p:
            with pytest.raises(ScheduleError, match=f"multiple of the pipeline ranks num_ranks={p}"):
                make_schedule("interleaved", p, m, virtual_stages)
            continue
        result = simulate(make_schedule("interleaved", p, m, virtual_stages))
        # each chunk is 1/v of a layer stack but costs 1 here, so the ideal time is v*m*3 per rank
        assert abs(result.bubble_fraction - (p - 1) / (virtual_stages * m + p - 1)) < EXACT, (p, m)


def test_zb_h1_bubble_is_a_third_of_1f1b():
    for p, m in SIZES:
        zb, base = simulate(make_schedule("zb-h1", p, m)), simulate(make_schedule("1f1b", p, m))
        work = 3 * m  # F + B + W per microbatch on every rank
        zb_idle, base_idle = zb.total_time - work, base.total_time - work
        if m >= p:  # enough W's to fill the cool-down: idle (p-1)(F+B-W) against (p-1)(F+B+W)
            assert abs(zb_idle - base_idle / 3) < EXACT, (p, m)
        else:
            assert zb_idle <= base_idle, (p, m)
        assert list(zb.peak_activations) == [min(p - s, m) for s in range(p)], (p, m)


def test_costs_per_stage_from_a_function():
    # Stage 1 takes twice as long: it sets the pace. 1F1B ends after stage 0's first forward, stage 1's
    # m x (F + B + W), and stage 0's last backward; ZB-H1 hides that backward under stage 1's deferred W's.
    slow_last = lambda action: {0: 1.0, 1: 2.0}[action.stage]  # noqa: E731
    assert simulate(make_schedule("1f1b", 2, 4), slow_last).total_time == 1 + 4 * 6 + 2
    assert simulate(make_schedule("zb-h1", 2, 4), slow_last).total_time == 1 + 4 * 6
    # Per-kind costs: an unsplit backward costs B + W.
    assert simulate(make_schedule("1f1b", 2, 4), {"F": 2, "B": 3, "W": 1}).total_time == 5 * 6


def test_costs_read_off_a_measured_timeline():
    spans = [Span(0, "F0", "F", 0.0, 1.0), Span(0, "F1", "F", 1.0, 2.2), Span(1, "F0", "F", 1.1, 1.9)]
    spans += [Span(1, "B0", "B", 2.0, 4.0), Span(0, "W0", "W", 5.0, 5.5), Span(1, "x", "X", 1.0, 1.1)]
    costs = measured_costs(Timeline(2, tuple(spans)))
    assert costs == pytest.approx({"F": 1.0, "B": 2.0, "W": 0.5, "p2p": 0.1})  # medians per kind


def test_golden_grids():
    assert make_schedule("gpipe", 2, 2).grid() == "rank 0: F0 F1 B0 B1\nrank 1: F0 F1 B0 B1"
    assert make_schedule("1f1b", 2, 4).grid() == ("rank 0: F0 F1 B0 F2 B1 F3 B2 B3\nrank 1: F0 B0 F1 B1 F2 B2 F3 B3")
    assert make_schedule("zb-h1", 2, 3).grid() == (
        "rank 0: F0 F1 B0 F2 B1 W0 B2 W1 W2\nrank 1: F0 B0 F1 B1 F2 B2 W0 W1 W2"
    )
    assert make_schedule("interleaved", 2, 2, 2).grid() == (
        "rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\nrank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"
    )


def test_golden_lowering():
    program = simulate(make_schedule("1f1b", 2, 2)).program
    assert format_program(program) == (
        "rank 0: 0F0 [0SF0] 0F1 [0SF1 0RB0] 0B0 [0RB1] 0B1\nrank 1: [1RF0] 1F0 1B0 [1SB0 1RF1] 1F1 1B1 [1SB1]"
    )


def _custom(actions):
    per_rank = tuple(tuple(Action(a[1], r, int(a[2:])) for a in line.split()) for r, line in enumerate(actions))
    return Schedule("custom", len(actions), 2, 1, per_rank)


def test_deadlock_names_rank_and_action_and_marks_grid():
    # rank 0 waits for the gradient of microbatch 0 before sending microbatch 1's activations,
    # while rank 1 needs those activations before it computes that gradient.
    schedule = _custom(["xF0 xB0 xF1 xB1", "xF0 xF1 xB0 xB1"])
    with pytest.raises(DeadlockError) as info:
        simulate(schedule)
    err = info.value
    assert err.rank == 0 and err.action == "[0SF0 0RB0]"
    assert "rank 0 waits forever at step 1" in str(err)
    assert "needs rank 1 to send 1SB0, but rank 1 is stuck at step 2 ([1RF1])" in str(err)
    assert ">>[0SF0 0RB0]<<" in err.grid and ">>[1RF1]<<" in err.grid


def test_same_rank_order_error():
    # a backward before its own forward can never run
    with pytest.raises(DeadlockError, match=r"rank 0 waits forever at step 0 \(0B0\): 0B0 needs 0F0 first"):
        simulate(_custom(["xB0 xF0 xF1 xB1"]))


def test_incomplete_schedule_is_rejected():
    with pytest.raises(ScheduleError, match="rank 1: action 1B1 appears 0 times"):
        simulate(_custom(["xF0 xF1 xB0 xB1", "xF0 xF1 xB0"]))


def test_bad_arguments():
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'"):
        make_schedule("pipedream", 2, 2)
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive integer"):
        make_schedule("1f1b", 2, 0)
    with pytest.raises(ScheduleError, match=r"choose num_microbatches in \{4, 8, 12, \.\.\.\}"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="virtual_stages=2 needs 'interleaved'"):
        make_schedule("gpipe", 2, 2, 2)


def test_communication_cost_delays_the_receiver():
    # 1F1B, p=2, m=1, each exchange costs 0.5: F0 (1) + hop (0.5) + F0 (1) + B0 (2) + hop (0.5) + B0 (2) = 7
    result = simulate(make_schedule("1f1b", 2, 1), comm_cost=0.5)
    assert result.total_time == 7.0
    assert [(s.label, s.start) for s in result.timeline.spans if s.rank == 0] == [("0F0", 0.0), ("0B0", 5.0)]


def test_action_costs():
    # GPipe p=2, m=2 with F=2: forwards take (m+p-1)*F = 6, backwards (m+p-1)*(B+W) = 6
    assert simulate(make_schedule("gpipe", 2, 2), costs={"F": 2.0}).total_time == 12.0
