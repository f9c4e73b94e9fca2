"""What users of 0.4 already have still works now that rotary settings are ``[model.rope]`` and DeepSeek's
config is latent attention with experts rather than the MoE GPT's with fields refused: 0.4's config files
(the flat ``rope_*`` keys), and run folders and checkpoints 0.4 wrote (tests/fixtures/v0.4: a Llama with
Llama 3.1's scaling on dp2, DeepSeek's MLA with YaRN on tp2, whose saved configs list the GPT's attention
fields DeepSeek refused and every rope_* field). An old spelling reads as the new one, with one note."""

import dataclasses
import json
import math
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

ROOT = Path(__file__).resolve().parents[2]
V04 = ROOT / "tests" / "fixtures" / "v0.4"
RUNS = ("llama", "deepseek")

# The same models in today's spelling.
TODAY = {
    "llama": {"preset": "llama-tiny", "hidden": 16, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
              "context_length": 16, "rope": {"theta": 500000.0, "scaling": "llama3", "factor": 4.0,
                                             "original_context": 8}},
    "deepseek": {"kind": "deepseek-v3", "hidden": 16, "num_layers": 2, "num_heads": 2, "context_length": 16,
                 "mlp_hidden": 32, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
                 "v_head_dim": 4, "rope": {"factor": 4.0, "original_context": 8, "mscale": 1.0, "mscale_all_dim": 1.0},
                 "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden": 8, "score": "sigmoid", "bias_update_rate": 0.001,
                         "aux_loss_coef": 0.0}},
}  # fmt: skip


@pytest.mark.parametrize("run", RUNS)
def test_a_0_4_config_reads_as_today_with_a_note_per_old_key(run):
    notes: list[str] = []
    raw = read_toml(V04 / f"{run}-run.toml")
    old = from_dict(raw, note=notes.append)
    new = from_dict({**raw, "model": TODAY[run]})
    assert old.model == new.model
    flat = [key for key in raw["model"] if key.startswith("rope_")]
    new_name = {"rope_scale_factor": "factor"}  # the others lose their prefix
    rope = [f"note: model.{key} is now model.rope.{new_name.get(key, key.removeprefix('rope_'))} (read as such)"
            for key in flat]  # fmt: skip
    evaluation = [f"note: training.{key} is now eval.{key.removeprefix('eval_')} (read as such)"
                  for key in ("eval_every", "sample_tokens")]  # fmt: skip
    assert notes == evaluation + rope  # [training] is read before [model]: a section at a time


@pytest.mark.parametrize("run", RUNS)
def test_a_0_4_checkpoint_reads_reshards_and_consolidates(run, tmp_path):
    source = Checkpoint(next((V04 / f"{run}-run" / "checkpoints").iterdir()))
    config = saved_config(source)  # DeepSeek's refused GPT attention fields passed over, rope_* read as [model.rope]
    assert config.model == from_dict({"model": TODAY[run]}).model
    weights = consolidate(source)
    one = target_config(source, {"tp": 1, "dp": 1})
    reshard(source, tmp_path / "one", one)
    resharded = consolidate(next((tmp_path / "one").iterdir()))
    assert weights.keys() == resharded.keys()
    for name, tensor in weights.items():  # a layout change moves bytes, it changes none
        assert torch.equal(tensor, resharded[name]), name


@pytest.mark.long
@pytest.mark.parametrize("run", RUNS)
def test_a_0_4_run_folder_resumes_and_trains_as_0_4_did(run, tmp_path):
    """Resumed through the CLI, the run goes on to step 3 and saves today's spelling. A fresh run of the
    same file trains as 0.4 did: its first step's loss (the same initial weights and batch, one forward)
    equals the loss 0.4 logged up to float32 round-off: 1e-5 relative covers the forward's sums in another
    blocking on another CPU's kernels (a changed rotary rule or attention scale moves it by 1e-3 or more)."""
    folder = tmp_path / "run"
    shutil.copytree(V04 / f"{run}-run", folder)
    toml = V04 / f"{run}-run.toml"
    cli = [sys.executable, "-m", "polyshard.cli.main", "train", str(toml)]
    resumed = subprocess.run([*cli, "--out", str(folder), "--resume", "--set", "training.steps=3"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step 3/3" in resumed.stdout
    assert resumed.stderr.count("is now model.rope.factor") == 1
    saved = saved_config(Checkpoint(folder / "checkpoints" / "step_00000003"))
    assert dataclasses.asdict(saved.model)["rope"]["factor"] == 4.0  # saved in today's spelling
    fresh = subprocess.run([*cli, "--out", str(tmp_path / "fresh"), "--set", "training.steps=1"],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    first = [json.loads(line) for line in (V04 / f"{run}-run" / "metrics.jsonl").read_text().splitlines()][0]
    today = [json.loads(line) for line in (tmp_path / "fresh" / "metrics.jsonl").read_text().splitlines()][0]
    assert first["step"] == today["step"] == 1
    assert math.isclose(today["loss"], first["loss"], rel_tol=1e-5), (today["loss"], first["loss"])


@pytest.mark.long
@pytest.mark.parametrize("run", RUNS)
def test_a_0_4_checkpoint_exports_as_transformers_reads_it(run, tmp_path):
    """Both exports of a 0.4 checkpoint through the CLI: polyshard's file (loaded by polyshard.models.load)
    and a Hugging Face folder (Llama 3.1's rotary scaling, DeepSeek's YaRN and MLA written from today's
    [model.rope]) give the same logits. Tolerance 1e-5: float32 sums in transformers' order, not ours."""
    import transformers

    from polyshard.models import load

    step = next((V04 / f"{run}-run" / "checkpoints").iterdir())
    for fmt, out in (("polyshard", tmp_path / "model.safetensors"), ("hf", tmp_path / "hf")):
        done = subprocess.run([sys.executable, "-m", "polyshard.cli.main", "export", str(step), str(out),
                               "--format", fmt], capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = load(tmp_path / "model.safetensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
