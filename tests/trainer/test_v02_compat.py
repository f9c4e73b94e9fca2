"""What users of 0.2 already have still works: its config files (tests/fixtures/v0.2/configs, the
apps/configs of that version, MoE settings in the one flat [model] table), and a run folder and
checkpoint it wrote (tests/fixtures/v0.2/moe-run: an MoE GPT on ep=2 with a sigmoid router, whose
saved config lists every field 0.2 had). An old spelling reads as the new one, with one note."""

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyshard.checkpoint import Checkpoint
from polyshard.trainer import reshard, saved_config, target_config
from polyshard.trainer.checkpointing.run_export import consolidate
from polyshard.trainer.config import from_dict, read_toml
from polyshard.trainer.engine.constraints import validate

ROOT = Path(__file__).resolve().parents[2]
V02 = ROOT / "tests" / "fixtures" / "v0.2"
OLD_CONFIGS = sorted((V02 / "configs").glob("*.toml"))
STEP = V02 / "moe-run" / "checkpoints" / "step_00000002"


@pytest.mark.parametrize("path", OLD_CONFIGS, ids=lambda p: p.stem)
def test_every_config_0_2_shipped_still_reads_as_today(path):
    notes: list[str] = []
    old = from_dict(read_toml(path), world_size=8, note=notes.append)
    validate(old, world_size=old.parallel.world_size)
    today = ROOT / "apps" / "configs" / path.name
    if today.exists():  # the shipped file, in today's spelling, describes the same model on the same layout
        new = from_dict(read_toml(today), world_size=8)  # (the planning configs now train on synthetic data)
        assert (old.model, old.parallel, old.training) == (new.model, new.parallel, new.training)
    if old.model.kind == "moe-gpt" and "num_experts" in read_toml(path)["model"]:
        assert "note: model.num_experts is now model.moe.num_experts (read as such)" in notes


def test_the_old_spelling_is_named_once_each():
    notes: list[str] = []
    model = {"kind": "moe-gpt", "num_experts": 8, "router": "sigmoid", "router_groups": 2, "aux_loss_weight": 0.0}
    config = from_dict({"model": model}, note=notes.append)
    assert (config.model.moe.num_experts, config.model.moe.score, config.model.moe.groups) == (8, "sigmoid", 2)
    assert notes == [
        "note: model.num_experts is now model.moe.num_experts (read as such)",
        "note: model.router is now model.moe.score (read as such)",
        "note: model.router_groups is now model.moe.groups (read as such)",
        "note: model.aux_loss_weight is now model.moe.aux_loss_coef (read as such)",
    ]


def test_a_0_2_checkpoint_reads_reshards_and_consolidates(tmp_path):
    source = Checkpoint(STEP)
    config = saved_config(source)  # every 0.2 field recorded; the GPT's and the ViT's passed over
    assert config.model.kind == "moe-gpt" and config.model.moe.score == "sigmoid"
    assert config.model.moe.bias_update_rate == 0.001 and config.parallel.ep == 2
    weights = consolidate(source)
    one = target_config(source, {"ep": 1})
    reshard(source, tmp_path / "ep1", one)
    resharded = consolidate(next((tmp_path / "ep1").iterdir()))
    assert weights.keys() == resharded.keys()
    for name, tensor in weights.items():  # a layout change moves bytes, it changes none
        assert torch.equal(tensor, resharded[name]), name
    assert any(name.endswith("router.bias") for name in weights)  # the sigmoid router's selection bias


@pytest.mark.long
def test_a_0_2_run_folder_resumes_through_the_cli(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(V02 / "moe-run", run)
    done = subprocess.run(
        [sys.executable, "-m", "polyshard.cli.main", "train", str(V02 / "moe-run.toml"), "--out", str(run),
         "--resume", "--set", "training.steps=3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("note: model.num_experts is now model.moe.num_experts") == 1
    assert "step 3/3" in done.stdout
    resumed = saved_config(Checkpoint(run / "checkpoints" / "step_00000003"))
    assert dataclasses.asdict(resumed.model)["moe"]["score"] == "sigmoid"  # saved in today's spelling


def test_the_learning_rate_schedule_reads_under_its_old_name():
    notes: list[str] = []
    training = {"schedule": "wsd", "steps": 10, "warmup_steps": 2, "decay_fraction": 0.2}
    config = from_dict({"training": training}, note=notes.append)
    assert config.lr_schedule.name == "wsd" and config.lr_schedule.decay_fraction == 0.2
    assert notes == [
        "note: training.schedule is now lr_schedule.name (read as such)",
        "note: training.warmup_steps is now lr_schedule.warmup_steps (read as such)",
        "note: training.decay_fraction is now lr_schedule.decay_fraction (read as such)",
    ]
