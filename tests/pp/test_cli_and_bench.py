"""`polyshard schedule` (in-process through typer's runner) and one benchmark case on two processes."""

import argparse
import json

import torch
from typer.testing import CliRunner

from polyshard.bench import pp as bench
from polyshard.cli.main import app


def test_schedule_command_prints_grid_and_writes_json_and_svg(tmp_path):
    out, svg = tmp_path / "s.json", tmp_path / "s.svg"
    args = ["schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json", str(out), "--svg", str(svg)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7" in result.output
    assert "bubble fraction  0.2727" in result.output and "peak activations [4, 3, 2, 1]" in result.output
    assert json.loads(out.read_text()) == {
        "schedule": "1f1b",
        "stages": 4,
        "microbatches": 8,
        "bubble_fraction": 3 / 11,
        "peak_activations": [4, 3, 2, 1],
        "total_time": 33.0,
        "costs": {"F": 1.0, "B": 1.0, "W": 1.0, "p2p": 0.0},
    }
    # The label says what the drawing shows: an unsplit backward is B + W = 2 units wide.
    assert "(F = 1, B = 1, W = 1, p2p = 0; a backward not split into B and W takes B + W = 2)" in result.output
    assert svg.read_text().startswith("<svg") and "simulated bubble 0.273" in svg.read_text()


def test_schedule_command_draws_v_schedules():
    result = CliRunner().invoke(app, ["schedule", "zb-v", "--stages", "2", "--microbatches", "3"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("zb-v p=2 m=3 v=2")  # two stages per rank without asking
    assert "rank 1: 1F0 2F0 1F1 2F1 2B0 1B0" in result.output  # stage numbers: rank 1 holds 1 and 2
    assert "peak activations [4, 4]" in result.output
    result = CliRunner().invoke(app, ["schedule", "dualpipev", "-p", "2", "-m", "3"])
    assert result.exit_code == 2 and "choose num_microbatches >= 4" in result.output


def test_schedule_command_takes_action_costs(tmp_path):
    out = tmp_path / "s.json"
    args = ["schedule", "1f1b", "-p", "2", "-m", "4", "--forward", "2", "--backward", "3", "--weight", "1"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["total_time"] == (4 + 2 - 1) * (2 + 3 + 1)  # 1F1B: (m + p - 1)(F + B + W)
    assert CliRunner().invoke(app, [*args, "--p2p", "0.5", "--json", str(out), "--overwrite"]).exit_code == 0
    assert json.loads(out.read_text())["total_time"] > 30  # transfers lie on the critical path
    bad = CliRunner().invoke(app, ["schedule", "1f1b", "-p", "2", "-m", "4", "--forward", "-1"])
    assert bad.exit_code == 2 and "--forward" in bad.output


def test_schedule_command_rejects_bad_microbatches():
    result = CliRunner().invoke(app, ["schedule", "interleaved", "-p", "4", "-m", "6"])
    assert result.exit_code == 2 and "choose num_microbatches in {4, 8, 12" in result.output


def _bench_case(name):
    torch.manual_seed(0)
    args = argparse.Namespace(layers=4, hidden=16, microbatches=4, iters=1, svg=None)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    return bench._case(name, args, x, y)


def test_bench_case_matches_torch_pipelining(distributed):
    for name in ("1f1b", "interleaved", "zb-v", "dualpipev"):
        record = distributed.run(2, _bench_case, name)[0]
        assert record["outputs_match"], record  # same losses and gradients as PyTorch's schedule
        assert record["ours_s"] > 0 and record["peer_s"] > 0 and 0 < record["bubble_theory"] < 1
        # the replay of measured compute times is a bubble too; the step's shares are parts of it
        assert 0 <= record["bubble_sim_measured"] < 1
        shares = record["share_post"] + record["share_wait"] + record["share_other"]
        assert all(record[k] >= 0 for k in ("share_post", "share_wait", "share_other"))
        assert abs(shares - record["bubble_measured"]) < 1e-6  # bubble = posting + waiting + the rest
