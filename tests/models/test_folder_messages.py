"""A Hugging Face folder's settings are the file's (issue 46): a size no run can take is reported as the
folder's config.json and its key, not as a ``[model]`` field with a ``--set`` fix; DeepSeek's rotary dims
are its qk_rope_head_dim (the non-rotary ones may be odd); and every refusal the CLI prints is one line of
bounded length. Only config.json is written (the refusals come before any weight is read)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polyshard.models.hf_adapters import hf_adapters
from polyshard.models.hf_keys import in_folder_terms, setting_keys
from polyshard.trainer.config import from_dict

transformers = pytest.importorskip("transformers")

MIXTRAL = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "max_position_embeddings": 64,
}
DEEPSEEK = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
            "n_routed_experts": 8, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "qk_nope_head_dim": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
            "max_position_embeddings": 64, "q_lora_rank": 24, "n_group": 2, "topk_group": 1}  # fmt: skip


def _folder(tmp_path: Path, name: str, config: object, **edits: object) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    hf = {**config.to_dict(), **edits}  # type: ignore[attr-defined]
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


def _train(tmp_path: Path, monkeypatch, *args: str):
    from polyshard.cli import train as train_cli
    from polyshard.cli.main import app

    started: list[int] = []
    monkeypatch.setattr(train_cli, "run_local", lambda nproc, *a, **k: started.append(nproc) or 0)
    toml = tmp_path / "c.toml"
    toml.write_text('[training]\nsteps = 2\nglobal_batch_size = 4\n[data]\nsource = "synthetic"\n')
    result = CliRunner().invoke(app, ["train", str(toml), "--out", str(tmp_path / "run"), *args])
    assert started == [] and not (tmp_path / "run").exists()
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize(
    ("name", "config", "edits", "said"),
    [
        ("mixtral", "MixtralConfig", {"num_local_experts": 10**9}, "num_local_experts = 1000000000 is past 65,536"),
        ("deepseek", "DeepseekV3Config", {"qk_rope_head_dim": 7}, "qk_rope_head_dim = 7 must be even"),
    ],
)
def test_a_folder_setting_is_named_as_its_config_json_key(tmp_path, monkeypatch, name, config, edits, said):
    made = getattr(transformers, config)(**(MIXTRAL if name == "mixtral" else DEEPSEEK))
    folder = _folder(tmp_path, name, made, **edits)
    line = _train(tmp_path, monkeypatch, "--init-from", f"hf:{folder}")
    where = folder / "config.json"
    assert line == f"checkpoint error: {where}: {line.split(f'{where}: ', 1)[1]}"
    assert said in line and line.endswith(f"; correct {where} or use another folder")
    assert "--set" not in line and "model." not in line and "head_dim (" not in line


def test_deepseek_rotates_only_its_rope_dims():
    # qk_nope 7 + qk_rope 8 = 15 dims a head: valid (only the 8 rotate); it was refused as an odd head dim
    from_dict({"model": {"kind": "deepseek-v3", "qk_nope_head_dim": 7, "qk_rope_head_dim": 8}})


def test_the_keys_each_setting_came_from():
    families = hf_adapters()
    hf = transformers.MixtralConfig(**MIXTRAL).to_dict()
    keys = setting_keys(families["mixtral"], hf, "config.json")
    assert keys["moe.num_experts"] == "num_local_experts" and keys["hidden"] == "hidden_size"
    assert keys["num_layers"] == "num_hidden_layers" and keys["moe.top_k"] == "num_experts_per_tok"
    message = "model.moe.top_k=3 exceeds model.moe.num_experts=2; set it lower, e.g. --set model.moe.top_k=2"
    assert in_folder_terms(message, keys, "f/config.json") == (
        "f/config.json: num_experts_per_tok = 3 exceeds num_local_experts = 2; correct f/config.json or use "
        "another folder"
    )


def test_a_very_long_message_is_cut_with_a_note(tmp_path, monkeypatch):
    value = "x" * 1_000_000  # the issue saw 10,255,370 characters on one line
    line = _train(tmp_path, monkeypatch, "--set", f"lr_schedule.name='{value}'")
    assert line.startswith("config error: lr_schedule.name='xxx") and len(line) < 2_100
    assert line.endswith("more characters cut)")
