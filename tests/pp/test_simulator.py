"""Schedules through the tensor-free simulator: no deadlock, and the textbook figures.

Costs F = B = W = 1 (an unsplit backward costs B + W = 2). The formulas are
exact for these costs with free communication, so the checks use 1e-9, which
only absorbs float rounding of the sums.
"""

import pytest

from polyshard.pp import (
    Action,
    DeadlockError,
    Exchange,
    Kind,
    Schedule,
    ScheduleError,
    Span,
    Timeline,
    format_program,
    lower,
    make_schedule,
    measured_costs,
    simulate,
    v_placement,
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


V_SIZES = [(p, m) for p in range(1, 9) for m in range(1, 2 * p + 6)]


def test_zb_v_zero_bubble_at_1f1b_memory():
    # Qi et al.'s ZB-V with T_F = T_B = T_W: once m >= 2p-1, no rank idles between its first and its
    # last action, and each holds at most 2p (stage, microbatch) activations (two half-size stages:
    # p microbatches of its layers, 1F1B's first stage). The step takes 6m chunk-units plus the
    # start-up stagger p-1. Fewer microbatches still run, within the same memory.
    for p, m in V_SIZES:
        result = simulate(make_schedule("zb-v", p, m))
        assert max(result.peak_activations) <= 2 * p, (p, m)
        if m >= 2 * p - 1:
            assert all(result.idle_within(r) == 0 for r in range(p)), (p, m)
            assert result.total_time == 6 * m + p - 1, (p, m)
            assert list(result.peak_activations) == [2 * p] * p, (p, m)


def test_dualpipev_bubble_and_memory():
    # DeepSeek's DualPipeV figures for PP = 2p stages on p ranks: activations PP+1 = 2p+1 per rank,
    # bubble (PP/2-1)(F&B + B - 3W) with B a full backward: with F = B = W = 1 (full backward 2) and
    # each overlapped pair costing F&B, (p-1)(F&B - 1) on the most idle rank.
    for p, m in V_SIZES:
        if m < 2 * p:
            continue
        schedule = make_schedule("dualpipev", p, m)
        assert list(simulate(schedule).peak_activations) == [2 * p + 1] * p, (p, m)
        # F&B from fully overlapped (max(F, full B) = 2) to not overlapped at all (F + full B = 3)
        for pair in (2.0, 2.5, 3.0) if m in (2 * p, 2 * p + 3) else ():
            result = simulate(schedule, costs={"F&B": pair})
            bubble = max(result.total_time - result.timeline.busy(r) for r in range(p))
            assert abs(bubble - (p - 1) * (pair + 2 - 3)) < EXACT, (p, m, pair)
        # Run one after the other (our executor), each half starts as soon as its own input is there:
        # only the start-up stagger remains, p-1 on every rank.
        assert simulate(schedule).total_time == 6 * m + p - 1, (p, m)


def test_costs_per_stage_from_a_function():
    # Stage 1 takes twice as long: it sets the pace. 1F1B ends after stage 0's first forward, stage 1's
    # m x (F + B + W), and stage 0's last backward; ZB-H1 hides that backward under stage 1's deferred W's.
    # A cost function prices every action itself: a full (unsplit) backward is B + W, twice a forward here.
    def slow_last(action):
        return {0: 1.0, 1: 2.0}[action.stage] * (2 if action.kind is Kind.BACKWARD else 1)

    assert simulate(make_schedule("1f1b", 2, 4), slow_last).total_time == 1 + 4 * 6 + 2
    assert simulate(make_schedule("zb-h1", 2, 4), slow_last).total_time == 1 + 4 * 6
    # Per-kind costs: an unsplit backward costs B + W.
    assert simulate(make_schedule("1f1b", 2, 4), {"F": 2, "B": 3, "W": 1}).total_time == 5 * 6


def test_costs_read_off_a_measured_timeline():
    spans = [Span(0, "F0", "F", 0.0, 1.0), Span(0, "F1", "F", 1.0, 2.2), Span(1, "F0", "F", 1.1, 1.9)]
    spans += [Span(1, "B0", "B", 2.0, 4.0), Span(0, "W0", "W", 5.0, 5.5), Span(1, "x", "X", 1.0, 1.1)]
    costs = measured_costs(Timeline(2, tuple(spans)))
    assert costs == pytest.approx({"F": 1.0, "B": 2.0, "W": 0.5, "post": 0.1})  # medians per compute kind; mean posting


def test_golden_grids():
    assert make_schedule("gpipe", 2, 2).grid() == "rank 0: F0 F1 B0 B1\nrank 1: F0 F1 B0 B1"
    assert make_schedule("1f1b", 2, 4).grid() == ("rank 0: F0 F1 B0 F2 B1 F3 B2 B3\nrank 1: F0 B0 F1 B1 F2 B2 F3 B3")
    assert make_schedule("zb-h1", 2, 3).grid() == (
        "rank 0: F0 F1 B0 F2 B1 W0 B2 W1 W2\nrank 1: F0 B0 F1 B1 F2 B2 W0 W1 W2"
    )
    assert make_schedule("interleaved", 2, 2, 2).grid() == (
        "rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\nrank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"
    )
    # V placement: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    assert make_schedule("zb-v", 2, 3).grid() == (
        "rank 0: 0F0 0F1 0F2 3F0 3B0 3F1 3B1 0B0 3W0 0B1 3W1 3F2 3B2 0W0 0W1 0B2 3W2 0W2\n"
        "rank 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 1F2 2F2 2W0 1W0 2B2 1B2 2W1 1W1 2W2 1W2"
    )
    assert make_schedule("dualpipev", 2, 4).grid() == (
        "rank 0: 0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0B2 0W2 0B3 0W3\n"
        "rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2B3 1B3 2W3 1W3"
    )


def test_v_placement_is_data():
    schedule = make_schedule("zb-v", 4, 8)
    assert schedule.placement == v_placement(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert [schedule.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert schedule.rank_of(0) == schedule.rank_of(7) == 0  # the loss is computed where the input enters
    assert make_schedule("interleaved", 4, 8).stages_of(1) == [1, 5]  # the loop placement is the default


def test_golden_lowering():
    # [...] posts a batch of sends and receives, (...) waits for received data; with prefetch=1 (the
    # default) a receive is posted one compute action before the one that reads it
    program = simulate(make_schedule("1f1b", 2, 2)).program
    assert format_program(program) == (
        "rank 0: 0F0 [0SF0 0RB0] 0F1 [0SF1 0RB1] (0RB0) 0B0 (0RB1) 0B1\n"
        "rank 1: [1RF0] (1RF0) 1F0 [1RF1] 1B0 [1SB0] (1RF1) 1F1 1B1 [1SB1]"
    )
    assert format_program(lower(make_schedule("1f1b", 2, 2), prefetch=0)) == (
        "rank 0: 0F0 [0SF0] 0F1 [0SF1 0RB0] (0RB0) 0B0 [0RB1] (0RB1) 0B1\n"
        "rank 1: [1RF0] (1RF0) 1F0 1B0 [1SB0 1RF1] (1RF1) 1F1 1B1 [1SB1]"
    )


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"])
def test_posting_receives_early_hides_communication(name):
    # Each hop costs 0.25 of a forward. Posted one action ahead, a message travels while its receiver
    # computes; posted just before it is needed, its transfer starts only then (gloo's rendezvous).
    schedule = make_schedule(name, 4, 8)
    late, early = (simulate(schedule, comm_cost=0.25, program=lower(schedule, k)).total_time for k in (0, 1))
    free = simulate(schedule).total_time
    assert free < early < late, (free, early, late)


def test_receives_out_of_the_senders_order_are_rejected():
    # Messages between two ranks match in posting order: rank 1 must receive 0SF0 before 0SF1.
    schedule = make_schedule("gpipe", 2, 2)
    rank0, rank1 = lower(schedule)
    assert str(rank1[0]) == "[1RF0 1RF1]"
    swapped = (rank0, (Exchange(rank1[0].ops[::-1]), *rank1[1:]))
    with pytest.raises(ScheduleError, match="rank 1 posts its receives from rank 0 in another order than rank 0 sends"):
        simulate(schedule, program=swapped)


def _custom(actions):
    # "xF0 xB1": a forward of microbatch 0 and a full backward of microbatch 1 on the rank's own stage
    kinds = {"F": Kind.FORWARD, "B": Kind.BACKWARD}
    per_rank = tuple(tuple(Action(kinds[a[1]], r, int(a[2:])) for a in line.split()) for r, line in enumerate(actions))
    return Schedule("custom", len(actions), 2, 1, per_rank)


def test_deadlock_names_rank_and_action_and_marks_grid():
    # rank 0 waits for the gradient of microbatch 0 before sending microbatch 1's activations,
    # while rank 1 needs those activations before it computes that gradient.
    schedule = _custom(["xF0 xB0 xF1 xB1", "xF0 xF1 xB0 xB1"])
    with pytest.raises(DeadlockError) as info:
        simulate(schedule)
    err = info.value
    assert err.rank == 0 and err.action == "(0RB0)"
    assert "rank 0 waits forever at step 3" in str(err)
    assert "needs rank 1 to send 1SB0, but rank 1 is stuck at step 3 ((1RF1))" in str(err)
    assert ">>(0RB0)<<" in err.grid and ">>(1RF1)<<" in err.grid


def test_same_rank_order_error():
    # a backward before its own forward can never run
    with pytest.raises(DeadlockError, match=r"rank 0 waits forever at step 0 \(0B0\): 0B0 needs 0F0 first"):
        simulate(_custom(["xB0 xF0 xF1 xB1"]))


def test_incomplete_schedule_is_rejected():
    with pytest.raises(ScheduleError, match="rank 1: stage 1 microbatch 1 has 1 forward, 0 full backward"):
        simulate(_custom(["xF0 xF1 xB0 xB1", "xF0 xF1 xB0"]))


def test_bad_arguments():
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'"):
        make_schedule("pipedream", 2, 2)
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive integer"):
        make_schedule("1f1b", 2, 0)
    with pytest.raises(ScheduleError, match=r"choose num_microbatches in \{4, 8, 12, \.\.\.\}"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="'gpipe' puts 1 stage.s. on each rank, not virtual_stages=2"):
        make_schedule("gpipe", 2, 2, 2)
    with pytest.raises(ScheduleError, match="'zb-v' puts 2 stage.s. on each rank, not virtual_stages=1"):
        make_schedule("zb-v", 2, 4, 1)
    with pytest.raises(ScheduleError, match="dualpipev needs at least 2 x num_ranks = 4 microbatches"):
        make_schedule("dualpipev", 2, 3)
    with pytest.raises(ScheduleError, match="must give each of the 2 ranks exactly virtual_stages=2"):
        Schedule("custom", 2, 1, 2, ((), ()), placement=(0, 0, 0, 1))
    with pytest.raises(ScheduleError, match="is not a polyshard.pp.Kind"):
        Action("F", 0, 0)


def test_communication_cost_delays_the_receiver():
    # 1F1B, p=2, m=1, each exchange costs 0.5: F0 (1) + hop (0.5) + F0 (1) + B0 (2) + hop (0.5) + B0 (2) = 7
    result = simulate(make_schedule("1f1b", 2, 1), comm_cost=0.5)
    assert result.total_time == 7.0
    assert [(s.label, s.start) for s in result.timeline.spans if s.rank == 0] == [("0F0", 0.0), ("0B0", 5.0)]


def test_action_costs():
    # GPipe p=2, m=2 with F=2: forwards take (m+p-1)*F = 6, backwards (m+p-1)*(B+W) = 6
    assert simulate(make_schedule("gpipe", 2, 2), costs={"F": 2.0}).total_time == 12.0


def test_posting_an_exchange_keeps_its_rank_busy():
    # GPipe p=2 m=1 lowers to rank 0: [post RB0] F0 [post SF0] (wait RB0) B0 and rank 1: [post RF0]
    # (wait RF0) F0 B0 [post SB0]. Each posting costs 0.25 on its rank and a send leaves when its
    # posting ends: 0.25 + F 1 + 0.25 on rank 0, then F 1 + B 2 + 0.25 on rank 1, then B 2 = 6.75.
    result = simulate(make_schedule("gpipe", 2, 1), post_cost=0.25)
    assert abs(result.total_time - 6.75) < EXACT
    posts = [s for s in result.timeline.spans if s.kind == "X"]
    assert len(posts) == 4 and all(abs(s.end - s.start - 0.25) < EXACT for s in posts)
    # posting is not work: the bubble counts it idle, as measured timelines do
    assert abs(result.bubble_fraction - (1 - 6 / (2 * 6.75))) < EXACT
    assert abs(result.bubble_fraction - result.timeline.bubble_fraction) < EXACT
