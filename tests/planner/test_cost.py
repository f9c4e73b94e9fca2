"""The cost model's pieces: profiles, the link fit, the pipeline's use of the simulator, and sense checks."""

import dataclasses

import pytest

from polyshard.planner.calibrate import fit_link
from polyshard.planner.cost import crosses_nodes, estimate_step, stage_costs
from polyshard.planner.pipeline import PipelineCosts, peak_in_flight, step_time
from polyshard.planner.profile import BUILTIN, Profile, load_profile
from polyshard.pp import make_schedule, simulate
from polyshard.trainer.config import ParallelConfig, from_dict
from polyshard.trainer.errors import ConfigError

from ._machine import flat_profile


def _laid_out(config, **parallel):
    """``config`` with these fields of its parallel section changed."""
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **parallel))


def test_profiles_round_trip_through_json_and_load_by_name(tmp_path):
    for profile in [*BUILTIN.values(), flat_profile()]:
        assert Profile.from_json(profile.to_json()) == profile
    path = tmp_path / "p.json"
    path.write_text(flat_profile().to_json())
    assert load_profile(path) == flat_profile() and load_profile("h100-nvlink-ib") is BUILTIN["h100-nvlink-ib"]
    with pytest.raises(ConfigError, match="neither a built-in"):
        load_profile(tmp_path / "missing.json")
    path.write_text('{"name": "x"}')
    with pytest.raises(ConfigError, match="not a polyshard profile"):
        load_profile(path)
    path.write_text("[" * 100_000 + "]" * 100_000)  # nested past the parser's recursion: one line, no traceback
    with pytest.raises(ConfigError, match="not a polyshard profile .RecursionError"):
        load_profile(path)


def test_link_fit_recovers_latency_and_bandwidth():
    points = [(x, 50e-6 + x / 2e9) for x in (1e3, 1e5, 1e6, 4e6)]
    link = fit_link(points)
    assert link.latency_s == pytest.approx(50e-6) and link.busbw_gbps == pytest.approx(2.0)


def test_collective_time_is_latency_plus_bytes_over_bus_bandwidth():
    profile = flat_profile()
    assert profile.collective_s("all_reduce", 2, 1e9, 1.0) == pytest.approx(10e-6 + 1.0)
    assert profile.collective_s("all_reduce", 4, 1e9, 1.5) == pytest.approx(3 * 10e-6 + 1.5)  # 3 ring steps
    assert profile.collective_s("all_reduce", 1, 1e9, 1.0) == 0.0


def test_a_step_of_more_microbatches_pays_more_fixed_costs():
    config = from_dict({"model": {"preset": "tiny"}, "training": {"global_batch_size": 16}})
    profile = flat_profile(block_overhead_s={1: {64: 1e-3}})
    one, four = (estimate_step(_laid_out(config, microbatches=m), profile).step_s for m in (1, 4))
    assert four == pytest.approx(one + 3 * 4 * 1e-3)  # 3 more microbatches through 4 blocks


def test_groups_cross_nodes_by_their_stride():
    profile = flat_profile(devices_per_node=8)
    parallel = ParallelConfig(dp=4, tp=8, pp=2)  # tp is the fastest axis: inside a node; dp strides by 8
    assert not crosses_nodes("tp", parallel, profile) and crosses_nodes("dp", parallel, profile)
    assert not crosses_nodes("dp", ParallelConfig(dp=2, tp=4), profile)


def test_pipeline_time_comes_from_the_simulator_and_extrapolates_long_steps():
    costs = PipelineCosts((1.0, 2.0), (1.0, 2.0), (1.0, 2.0), p2p=0.25)
    schedule = make_schedule("1f1b", 2, 8)
    assert step_time("1f1b", 2, 8, 1, costs) == simulate(schedule, costs.of, comm_cost=0.25).total_time
    # Beyond the simulated length the figures continue in a straight line; exact for 1F1B and GPipe.
    for name in ("1f1b", "gpipe", "zb-h1"):
        long = simulate(make_schedule(name, 2, 100), costs.of, comm_cost=0.25).total_time
        assert step_time(name, 2, 100, 1, costs) == pytest.approx(long, rel=1e-9)
        assert peak_in_flight(name, 2, 100) == simulate(make_schedule(name, 2, 100)).peak_activations


def test_step_time_senses():
    profile = flat_profile()
    config = from_dict({"model": {"preset": "tiny"}, "training": {"global_batch_size": 16}})
    one = estimate_step(config, profile)
    costs = stage_costs(config, range(0, 6), profile)
    assert one.parts["pipeline"] == pytest.approx(costs.forward + costs.backward + costs.weight)
    faster = dataclasses.replace(profile, matmul_tflops={1: {64: 2.0}}, elementwise_gbps={1: {64: 2.0}})
    assert estimate_step(config, faster).parts["pipeline"] == pytest.approx(one.parts["pipeline"] / 2)
    pp = _laid_out(config, pp=2, microbatches=4)
    zb = _laid_out(pp, schedule="zb-h1")
    assert estimate_step(zb, profile).step_s < estimate_step(pp, profile).step_s
    training = dataclasses.replace(config.training, activation_checkpointing=True)
    checkpointed = dataclasses.replace(config, training=training)
    assert estimate_step(checkpointed, profile).step_s > one.step_s  # the forward runs twice


@pytest.mark.long  # a minute on a loaded 2-core machine (most of it the workers' first AdamW step and startup)
def test_quick_calibration_measures_every_table():
    from polyshard.planner.calibrate import QUICK, calibrate

    profile = calibrate(processes=(1, 2), sweep=QUICK, log=lambda line: None)
    assert set(profile.matmul_tflops) == {1, 2} and set(profile.collectives) == {1, 2}
    assert all(v > 0 for table in profile.matmul_tflops.values() for v in table.values())
    assert all(v > 0 for table in profile.elementwise_gbps.values() for v in table.values())
    for op, placements in profile.collectives[2].items():
        link = placements["intra"][2]
        assert link.latency_s >= 0 and link.busbw_gbps > 0, op
    assert Profile.from_json(profile.to_json()) == profile


def test_bench_report_ranks_and_counts():
    from polyshard.bench.plan import LAYOUTS, Row, report, tiny_gpt

    config = tiny_gpt()
    six = [
        Row(name, dataclasses.replace(config, parallel=parallel), 0.1 * (i + 1), [0.1 * (i + 1) * 1.1] * 3)
        for i, (name, parallel) in enumerate(LAYOUTS.items())
    ]
    auto = Row("auto: dp4", _laid_out(config, dp=4), 0.1, [0.105])
    text = report(six, auto, six[0])
    assert "rankings equal; 6 of 6 predictions within 25%" in text
    assert "| dp2 (dp2 m1 z0) | 0.100 | 0.110 | -9% | 1 | 1 |" in text and "+-5%" not in text
