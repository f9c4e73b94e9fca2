"""``--init-from hf:DIR`` takes the model's settings from the folder's ``config.json``: a ``[model]`` table
may be left out, or set only what differs from the folder in ways a run may choose (a shorter context,
dropout). A setting that disagrees with the folder is refused before any process starts, naming the field,
both values and the fix. Tried as a user would: ``polyshard train`` on tiny folders built locally with
``transformers`` (nothing is downloaded), ``--dry-run`` and a 2-step run.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from polyshard.models.settings import with_folder_settings
from polyshard.trainer.checkpointing.hugging_face import model_settings
from polyshard.trainer.config import from_dict
from polyshard.trainer.errors import ConfigError

transformers = pytest.importorskip("transformers")

SIZES = {
    "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 16, "intermediate_size": 40,
}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    t = transformers
    made = {}
    for name, config in {
        "llama": t.LlamaConfig(**SIZES),
        # An MoE whose first block is dense (decoder_sparse_step 2): the layers that differ come along too.
        "qwen2_moe": t.Qwen2MoeConfig(
            **SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, decoder_sparse_step=2,
        ),
    }.items():  # fmt: skip
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(name)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        made[name] = folder
    return made


def _train(tmp_path, corpus, folder, model_toml="", *more):
    from polyshard.cli.main import app

    toml = model_toml + "[training]\nsteps = 2\nglobal_batch_size = 4\n[eval]\nevery = 0\nsample_tokens = 0\n"
    toml += f"[data]\nsource = {json.dumps(corpus)}\n[logging]\nprogress_bar = false\n"
    (tmp_path / "c.toml").write_text(toml)
    args = ["train", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--init-from", f"hf:{folder}", *more]
    return CliRunner().invoke(app, args)


def test_the_table_is_completed_from_the_folder(folders):
    folder = model_settings(folders["qwen2_moe"])
    assert folder["moe.dense_layers"] == [0] and folder["kind"] == "moe-gpt"
    # Nothing set: the folder's model. A shorter context and dropout set here stay; old flat spellings
    # (top_k) are read as their [model.moe] keys, so the folder's value does not come back beside them.
    assert from_dict({"model": with_folder_settings({}, folder)}).model == from_dict({"model": folder}).model
    merged = with_folder_settings({"context_length": 8, "dropout": 0.1, "top_k": 1}, folder)
    model = from_dict({"model": merged}).model
    assert (model.context_length, model.dropout, model.moe.top_k, model.moe.num_experts) == (8, 0.1, 1, 4)
    assert model.moe.dense_layers == [0] and model.dense_width == 40
    # A preset's values count as set: the check against the folder then names what it changes.
    assert with_folder_settings({"preset": "qwen2-moe-tiny"}, folder)["hidden"] != folder["hidden"]
    # Another family is refused at once: its settings would not even be the same fields.
    for other in ({"kind": "gpt"}, {"preset": "qwen3-tiny"}):
        with pytest.raises(ConfigError, match="model.kind='gpt' here .by kind or preset., 'moe-gpt' in the folder"):
            with_folder_settings(other, folder)


@pytest.mark.long  # a whole training job (8 s); the folder-settings rules stay in make test
def test_a_run_without_a_model_table_trains_the_folders_model(folders, corpus, tmp_path):
    result = _train(tmp_path, corpus, folders["llama"], "", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    result = _train(tmp_path, corpus, folders["llama"], "[model]\ncontext_length = 8\n", "--nproc", "1")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ended"] == "completed" and len(summary["losses"]) == 2
    # The run folder holds the model the workers built: the folder's, with the shorter context set here.
    model = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    expected = {**model_settings(folders["llama"]), "context_length": 8}
    assert from_dict({"model": model}).model == from_dict({"model": expected}).model


def test_a_setting_that_disagrees_is_refused_with_both_values(folders, corpus, tmp_path):
    result = _train(tmp_path, corpus, folders["qwen2_moe"], "[model.moe]\nnum_experts = 8\n", "--dry-run")
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "model.moe.num_experts=8 here, 4 in the folder" in line and "--set model.moe.num_experts=4" in line
    assert "Traceback" not in line and len(line.splitlines()) == 1
    result = _train(tmp_path, corpus, folders["qwen2_moe"], "", "--dry-run")  # the folder's own: fine
    assert result.exit_code == 0, result.output
    assert "model: moe-gpt," in result.output and "active per token" in result.output  # the folder's MoE
