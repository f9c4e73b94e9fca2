"""`polyshard plan`: the ranked table, --json, fixed axes, every way of naming a model, and bad input."""

import json

import pytest
from typer.testing import CliRunner

from polyshard.cli.main import app
from polyshard.planner.search import memory_of
from polyshard.trainer.config import from_dict

from ..planner._machine import flat_profile


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "flat.json"
    path.write_text(flat_profile(memory_gb=1.0, devices_per_node=4).to_json())
    return str(path)


def _plan(*args):
    return CliRunner().invoke(app, ["plan", *args])


def test_plan_ranks_layouts_and_writes_json(tmp_path, profile):
    out = tmp_path / "plan.json"
    result = _plan("tiny", "--devices", "4", "--global-batch", "16", "--profile", profile, "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "layouts considered" in result.output and "step s" in result.output
    plan = json.loads(out.read_text())
    assert set(plan) >= {"per_rank_gb", "comm_bytes", "step_s", "layouts"}
    steps = [entry["step_s"] for entry in plan["layouts"]]
    assert steps == sorted(steps) and plan["step_s"] == steps[0]
    best = dict(plan["layouts"][0]["layout"])
    training = {"global_batch_size": 16, "activation_checkpointing": best.pop("activation_checkpointing")}
    config = from_dict({"model": {"preset": "tiny"}, "parallel": best, "training": training})
    assert config.parallel.world_size == 4
    # The same numbers as the planner's memory model for that layout (which --dry-run prints too).
    assert plan["per_rank_gb"]["total"] == pytest.approx(memory_of(config).total / 1e9)


def test_fixed_axes_hold_in_every_layout(tmp_path, profile):
    out = tmp_path / "plan.json"
    args = ["tiny", "--devices", "4", "--global-batch", "16", "--tp", "2", "--zero", "0", "--profile", profile]
    assert _plan(*args, "--json", str(out)).exit_code == 0
    layouts = [entry["layout"] for entry in json.loads(out.read_text())["layouts"]]
    assert layouts and all(entry["tp"] == 2 and entry["zero_stage"] == 0 for entry in layouts)


def _layouts(tmp_path, *args):
    out = tmp_path / "plan.json"
    result = _plan(*args, "--json", str(out), "--overwrite")  # each call replaces the last plan
    assert result.exit_code == 0, result.output
    return [entry["layout"] for entry in json.loads(out.read_text())["layouts"]]


def test_every_choice_the_search_makes_can_be_fixed(tmp_path, profile):
    base = ["llama-tiny", "--devices", "8", "--global-batch", "16", "--profile", profile, "--memory-gb", "100"]
    # sequence parallelism with each ZeRO stage (FSDP + TP + SP), fixed on, and context parallelism fixed
    layouts = _layouts(tmp_path, *base, "--tp", "2", "--cp", "2", "--sequence-parallel", "--zero", "3")
    assert layouts and all(e["sequence_parallel"] and e["cp"] == 2 and e["zero_stage"] == 3 for e in layouts)
    layouts = _layouts(tmp_path, *base, "--no-sequence-parallel", "--activation-checkpointing", "full")
    assert layouts and all(not e["sequence_parallel"] and e["activation_checkpointing"] == "full" for e in layouts)
    # an interleaved pipeline of 3 stages a rank: llama-tiny's 2 blocks + embedding + head split 2 x 3 ways
    layouts = _layouts(tmp_path, *base, "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "3")
    assert layouts and all(e["virtual_stages"] == 3 and e["schedule"] == "interleaved" for e in layouts)
    # how cp splits attention, and the all-to-all group of Ulysses x ring (Llama 3's 131K run: all-gather cp 16)
    layouts = _layouts(tmp_path, *base, "--cp", "4", "--cp-style", "allgather")
    assert layouts and all(e["cp"] == 4 and e["cp_style"] == "allgather" for e in layouts)
    layouts = _layouts(tmp_path, *base, "--cp", "4", "--cp-style", "ulysses+ring", "--cp-ulysses", "2")
    assert layouts and all(e["cp_style"] == "ulysses+ring" and e["cp_ulysses"] == 2 for e in layouts)


def test_plan_prints_the_flop_convention_it_uses(profile):
    from polyshard.models.flops import flops_per_token

    result = _plan("tiny", "--devices", "2", "--global-batch", "8", "--profile", profile)
    assert result.exit_code == 0, result.output
    tokens = flops_per_token(from_dict({"model": {"preset": "tiny"}}).model)
    assert f"FLOPs per token {tokens:.4g} (polyshard.models.flops: 6N + " in result.output


def test_sequence_parallelism_is_weighed_with_every_zero_stage(tmp_path, profile):
    args = ["tiny", "--devices", "4", "--global-batch", "16", "--profile", profile, "--dp", "2", "--tp", "2"]
    layouts = _layouts(tmp_path, *args, "--sequence-parallel", "--microbatches", "1")
    assert {e["zero_stage"] for e in layouts} == {0, 1, 2, 3}


def test_pipelines_longer_than_thirty_two_stages_are_weighed(tmp_path, profile):
    # Megatron's 530B ran pp 35, its 1T pp 64: a stage per layer is the only limit
    toml = tmp_path / "deep.toml"
    toml.write_text('[model]\npreset = "tiny"\nnum_layers = 62\n[training]\nglobal_batch_size = 64\n')
    args = [str(toml), "--devices", "64", "--pp", "64", "--global-batch", "64", "--profile", profile]
    layouts = _layouts(tmp_path, *args, "--memory-gb", "100")
    assert layouts and all(e["pp"] == 64 for e in layouts)


def test_models_by_config_file_and_hugging_face_folder(tmp_path, profile):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npreset = "llama-tiny"\n[training]\nglobal_batch_size = 8\n')
    assert _plan(str(toml), "--devices", "2", "--profile", profile).exit_code == 0
    from transformers import LlamaConfig

    hf = tmp_path / "hf"
    LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=64).save_pretrained(hf)  # fmt: skip
    result = _plan(str(hf / "config.json"), "--devices", "2", "--global-batch", "8", "--profile", profile)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope", "--devices", "2"], "is not a preset"),
        (["tiny"], "give a model and --devices"),
        (["tiny", "--devices", "0"], "--devices"),
        (["tiny", "--devices", "4", "--profile", "no-such-profile"], "neither a built-in"),
        (["tiny", "--devices", "4", "--schedule", "fast"], "--schedule 'fast'"),
        (["tiny", "--devices", "4", "--tp", "3"], "do not divide"),
        (["tiny", "--devices", "4", "--memory-gb", "-1"], "--memory-gb"),
        (["tiny", "--devices", "4", "--precision", "fp8"], "training.precision"),
        (["tiny", "--devices", "4", "--cp", "3"], "do not divide"),
        (["tiny", "--devices", "4", "--cp-style", "spiral"], "--cp-style 'spiral'; choose one of"),
        (["tiny", "--devices", "4", "--activation-checkpointing", "some"], "choose none, full or selective"),
    ],
)
def test_bad_input_is_a_clear_error_with_exit_code_2(args, message, profile):
    result = _plan(*args, *(["--profile", profile] if "--profile" not in args else []))
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_nothing_fits_says_so(profile):
    result = _plan("tiny", "--devices", "2", "--memory-gb", "0.0001", "--profile", profile)
    assert result.exit_code == 1 and "no layout fits" in result.output
