"""The planner against published large runs (polyshard/planner/published_runs.toml): at each row's own layout,
the step time `polyshard plan` predicts (every axis fixed) against the one the paper's speed gives. The built-in
profiles' matmul fraction was fitted on the rows marked fit (polyshard.planner.calibrate_published); the check
rows were held out. `pytest -s` prints predicted against published per row."""

import math

import pytest

from polyshard.planner.calibrate_published import BOUNDS, fit_fraction, with_matmul_fraction
from polyshard.planner.profile import BUILTIN, MATMUL_FRACTION
from polyshard.planner.published import load_runs, predict, reported_flops_per_token
from polyshard.trainer.errors import ConfigError

RUNS = {run.name: run for run in load_runs()}
HEAVY = {"megatron-529.6b", "megatron-1t"}
"""Pipelines of 35 and 64 stages with 280 and 512 microbatches: 10-20 s each to simulate, so `make test-long`."""

OUTSIDE = {
    # name: (the error measured with the fitted profile, why it is outside 20% or at its edge: the 16K row is
    # +19.99%, inside by a hundredth of a point, so it is held to its measured value, not to the bound)
    "llama3-405b-16k-gpus": (
        0.200,
        "from 8K GPUs (32 microbatches a rank) to 16K (16) the paper lost 7% per GPU and the planner 12%: its "
        "pipeline of 16 x 4 stages goes from 13.74 to 7.58 s (+10% over half, the interleaved bubble's "
        "15/64 against 15/128), and ZeRO-1's reduce and gather after it stay 0.38 s (3% of the step, then 5%), "
        "hidden behind one microbatch's backward alone as our engine runs them; Llama 3's FSDP overlaps more",
    ),
}


def _error(name):
    run = RUNS[name]
    best = predict(run)
    error = best.step_s / run.published_step_s() - 1
    speed = f"{run.tflops_per_gpu:g} TFLOP/s" if run.tflops_per_gpu else f"{run.tokens_per_s_per_gpu:g} tok/s"
    print(
        f"\n{run.role:5s} {name:26s} {run.gpus:6d} {run.gpu} {speed:>14s}  published {run.published_step_s():8.3f} s"
        f"  predicted {best.step_s:8.3f} s  {error:+6.1%}  recompute {best.config.training.activation_checkpointing}"
    )
    return error


MODELED = [name for name, run in RUNS.items() if run.role != "unmodeled"]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.long) if n in HEAVY else n for n in MODELED], ids=MODELED
)
def test_published_run_is_predicted_within_20_percent(name):
    error = _error(name)
    if name in OUTSIDE:  # listed with its measured error: a change that moves it must update the list
        assert error == pytest.approx(OUTSIDE[name][0], abs=0.01), OUTSIDE[name][1]
    else:
        assert abs(error) < 0.20


def test_the_table_is_split_into_fitted_and_checked_rows_of_each_gpu():
    for gpu in ("h100", "h100-96gb", "a100"):
        roles = {run.role for run in RUNS.values() if run.gpu == gpu}
        assert {"fit", "check"} <= roles, gpu
    assert all(run.source and run.uncertain for run in RUNS.values())  # every row says what it rests on
    assert set(OUTSIDE) <= set(MODELED)


def test_megatron_convention_is_its_equation_3():
    # 1T: 96·l·h²(1 + s/6h + V/16lh) with l = 128, h = 25600, s = 2048, V = 51200
    run = RUNS["megatron-1t"]
    expected = 96 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    assert reported_flops_per_token(run) == pytest.approx(expected)
    # 163 TFLOP/s on 3,072 GPUs is the table's 502 PFLOP/s (rounded): 3072 x 2048 tokens in about 103 s
    assert run.published_step_s() == pytest.approx(3072 * 2048 * expected / (163e12 * 3072))
    assert 100 < run.published_step_s() < 105


def test_the_fit_balances_its_rows_inside_the_physical_bounds():
    rows = [RUNS["megatron-1.7b"]]  # the quickest row: the same search as any other
    fraction = fit_fraction(rows, "a100", rounds=6)
    low, high = BOUNDS["a100"]
    assert low < fraction < high
    profile = with_matmul_fraction(BUILTIN["a100-nvlink-ib"], "a100", fraction)
    balanced = predict(rows[0], profile).step_s / rows[0].published_step_s() - 1
    default = predict(rows[0], with_matmul_fraction(profile, "a100", 0.75)).step_s / rows[0].published_step_s() - 1
    assert abs(balanced) < 0.02 < abs(default)  # the fitted fraction, not the old 75%, meets the row
    # the stored constants are the fit's (within its bisection's step), inside the same bounds
    assert all(BOUNDS[gpu][0] <= MATMUL_FRACTION[gpu] <= BOUNDS[gpu][1] for gpu in BOUNDS)
    assert math.isclose(BUILTIN["a100-nvlink-ib"].matmul_flops(4096), MATMUL_FRACTION["a100"] * 312e12)


def test_a_bad_row_is_a_one_line_error(tmp_path):
    table = tmp_path / "runs.toml"
    table.write_text('[[run]]\nname = "x"\nrole = "guess"\n')
    with pytest.raises(ConfigError, match="runs.toml run 1 \\(x\\)"):
        load_runs(table)


# A search over every layout takes 20 s for 1.7B on 32 GPUs and minutes to a quarter hour for the 405B and
# larger rows; make test-long keeps the smallest (docs/guides/planner.md lists the picks of the others).
@pytest.mark.long
@pytest.mark.parametrize("name", ["megatron-1.7b"])
def test_layout_auto_on_a_published_run_picks_one_it_predicts_no_slower(name):
    from polyshard.planner.published import auto_choice
    from polyshard.planner.search import label

    run = RUNS[name]
    published, auto = predict(run), auto_choice(run)
    change = auto.step_s / published.step_s - 1
    print(
        f"\n{name:26s} published layout {published.step_s:8.3f} s; --layout auto: {label(auto.config)}, recompute "
        f"{auto.config.training.activation_checkpointing}, {auto.step_s:8.3f} s ({change:+.1%})"
    )
    # The published layout is among the candidates; the search screens them with the unit-cost pipeline before
    # simulating the best 32 exactly, so its pick can miss by that screen's error (a few percent), no more.
    assert auto.step_s <= published.step_s * 1.05
