"""MFU in every run: each metrics record and the summary carry model FLOPs per token, achieved TFLOP/s
per rank and MFU against a named peak, and the numbers agree with each other and with the step time."""

import json

import pytest
import torch

from polyshard.mesh import Mesh
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import train
from polyshard.trainer.loop.metrics import Progress, model_flops_per_token
from polyshard.trainer.loop.mfu import CALIBRATION, calibrated_peak, datasheet_peak, measure_peak

STEPS = 3
FIELDS = ("model_flops_per_token", "achieved_tflops_per_rank", "mfu", "peak_tflops", "peak_source")


def _config(corpus, peak_tflops=None, **parallel):
    return from_dict(
        {
            "model": {"hidden": 32, "num_layers": 2, "num_heads": 4, "context_length": 16},
            "parallel": parallel,
            "training": {"steps": STEPS, "global_batch_size": 8},
            "eval": {"every": 0, "sample_tokens": 0},
            "data": {"source": corpus},
            "logging": {"progress_bar": False, "peak_tflops": peak_tflops},
        }
    )


def _train(config, out):
    result = train(config, Mesh(config.parallel.mesh_axes), out, log=True)
    return result.speed, result.summary(STEPS)


def _check(config, out, speed, world):
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == STEPS
    seq = config.model.context_length
    flops_per_token = model_flops_per_token(config.model)
    for r in records:
        assert all(name in r for name in FIELDS), r
        assert r["model_flops_per_token"] == flops_per_token
        seconds = config.training.global_batch_size * seq / r["tokens_per_s"]  # the step's time
        achieved = flops_per_token * config.training.global_batch_size * seq / seconds / world / 1e12
        assert r["achieved_tflops_per_rank"] == pytest.approx(achieved, rel=1e-9)
        assert r["mfu"] == pytest.approx(r["achieved_tflops_per_rank"] / r["peak_tflops"], rel=1e-9)
        assert 0 < r["mfu"] < 1.5  # a tiny model: far below the peak, and never far above it
    assert {r["peak_source"] for r in records} == {speed["peak_source"]}
    assert speed["mfu"] == pytest.approx(speed["achieved_tflops_per_rank"] / speed["peak_tflops"], rel=1e-9)


@pytest.mark.parametrize("world, parallel", [(1, {}), (2, {"dp": 2})], ids=["one-process", "dp2"])
def test_every_record_and_the_summary_carry_a_consistent_mfu(distributed, corpus, tmp_path, world, parallel):
    config = _config(corpus, **parallel)
    speed, line = distributed.run(world, _train, config, tmp_path)[0]
    _check(config, tmp_path, speed, world)
    # No peak configured and no GPU: the calibration profile of this machine, or a measurement.
    assert speed["peak_source"].startswith(("calibration:", "measured at startup:"))
    assert f"mfu={speed['mfu']:.1%}" in line and "tokens_per_s=" in line


def test_a_configured_peak_is_used_and_named(distributed, corpus, tmp_path):
    config = _config(corpus, peak_tflops=0.5)
    speed, _ = distributed.run(1, _train, config, tmp_path)[0]
    _check(config, tmp_path, speed, 1)
    assert speed["peak_tflops"] == 0.5 and speed["peak_source"] == "logging.peak_tflops"


def test_peaks_from_the_datasheet_a_profile_and_a_measurement(tmp_path):
    assert datasheet_peak("NVIDIA H200", "bf16") == 989.0
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert datasheet_peak("NVIDIA H100 PCIe", "bf16") == 756.0
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert datasheet_peak("Tesla T4", "bf16") is None  # unknown: the run measures instead
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"matmul_tflops": {"1": {"64": 0.15, "256": 0.12}, "2": {"64": 0.1}}}))
    assert calibrated_peak(profile, 1) == 0.15 and calibrated_peak(profile, 3) == 0.1
    assert calibrated_peak(tmp_path / "none.json", 1) is None
    profile.write_text("[" * 100_000 + "]" * 100_000)  # nested too deeply to parse: no profile, no traceback
    assert calibrated_peak(profile, 1) is None
    assert CALIBRATION.name == "profile.json"
    state = torch.get_rng_state()
    assert measure_peak(torch.device("cpu"), torch.float32, budget_s=0.01, size=128) > 0
    assert torch.equal(torch.get_rng_state(), state)  # the measurement leaves dropout's generator alone


def test_the_progress_line_shows_mfu(capsys):
    Progress(1, enabled=True, interactive=False).update(0, 1.0, 100.0, 0.234)
    assert "100 tok/s mfu 23.4% eta" in capsys.readouterr().out
