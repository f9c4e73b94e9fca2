"""``--layout auto``: the planner picks the layout a run starts with, and the run checks the prediction."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polyshard.mesh import Mesh
from polyshard.planner.activations import activation_bytes
from polyshard.planner.auto import choose, laid_out, prediction
from polyshard.planner.model_states import rank_model_states
from polyshard.trainer.config import from_dict
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop import train
from polyshard.trainer.loop.plan_check import PlannedStep

from ._machine import flat_profile

ROOT = Path(__file__).resolve().parents[2]
POLYSHARD = [sys.executable, "-m", "polyshard.cli.main"]


def test_the_chosen_layout_goes_into_the_config_and_its_prediction_into_a_file(tmp_path):
    config = from_dict({"model": {"preset": "tiny"}, "training": {"global_batch_size": 16}})
    plan = choose(config, 4, flat_profile(memory_gb=1.0, devices_per_node=4))
    best = plan.ranked[0]
    steps = [c.step_s for c in plan.ranked]
    assert steps == sorted(steps)
    chosen = from_dict(laid_out({"model": {"preset": "tiny"}, "training": {"global_batch_size": 16}}, best))
    assert chosen.parallel == best.config.parallel
    assert chosen.training.activation_checkpointing == best.config.training.activation_checkpointing
    validate(chosen, world_size=4)
    expected = prediction(best)
    assert expected.step_s == best.step_s and len(expected.states_bytes) == chosen.parallel.pp
    assert expected.states_bytes[0] == rank_model_states(chosen, 0).total  # the chosen layout's, not the input's
    expected.write(tmp_path / "plan.json")
    assert PlannedStep.read(tmp_path / "plan.json") == expected
    (tmp_path / "bad.json").write_text(json.dumps({"step_s": -1, "states_bytes": [1], "activation_bytes": [1]}))
    with pytest.raises(ConfigError, match="bad.json: not a plan prediction"):
        PlannedStep.read(tmp_path / "bad.json")


@pytest.mark.long
def test_train_layout_auto_prints_the_candidates_and_why(tmp_path):
    profile = tmp_path / "flat.json"
    profile.write_text(flat_profile(memory_gb=1.0, devices_per_node=4).to_json())
    base = POLYSHARD + ["train", str(ROOT / "apps/configs/gpt-tiny-dp.toml"), "--layout", "auto"]
    result = subprocess.run(
        base + ["--nproc", "4", "--profile", str(profile), "--dry-run"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "layout planner:" in result.stdout and "chose " in result.stdout and "4 processes" in result.stdout
    missing = subprocess.run(base + ["--profile", str(profile)], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "--layout auto needs --nproc" in missing.stderr


def _planned_run(config, out, prediction):
    train(config, Mesh(config.parallel.mesh_axes), Path(out), prediction=prediction)
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "plan_step_s_predicted" in r]


def test_a_planned_run_logs_predicted_against_measured(distributed, corpus, tmp_path):
    config = from_dict(
        {
            "model": {"preset": "tiny"},
            "parallel": {"dp": 2, "zero_stage": 1},
            "training": {"steps": 5, "global_batch_size": 8},
            "eval": {"every": 0, "sample_tokens": 0},
            "data": {"source": corpus},
            "logging": {"progress_bar": False, "every": 10},
        }
    )
    states = float(rank_model_states(config, 0).total)
    planned = PlannedStep(step_s=0.5, states_bytes=(states,), activation_bytes=(float(activation_bytes(config, 0)),))
    [record] = distributed.run(2, _planned_run, config, str(tmp_path), planned)[0]
    assert record["step"] == 4 and record["plan_step_s_predicted"] == 0.5 and record["plan_step_s_measured"] > 0
    assert record["plan_states_bytes_held"] == record["plan_states_bytes_predicted"]  # to the byte
    saved, predicted = record["plan_activation_bytes_saved"], record["plan_activation_bytes_predicted"]
    assert abs(predicted - saved) <= 0.25 * saved
