"""DeepSeek-V3 and V2 (multi-head latent attention, dense first blocks, sigmoid group-limited routing with
a selection bias, a shared expert) in and out. A tiny random DeepSeek-V3 (4 heads, a q latent of 24, a kv
latent of 16, rotary 8 + non-rotary 8 q/k dims against 12 value dims; YaRN; 8 experts in 2 groups, top 2 within
the best group; a non-zero e_score_correction_bias; block 0 dense) and a DeepSeek-V2-Lite-like one (no q
latent, greedy softmax routing) are built with `transformers`, saved with save_pretrained (nothing is
downloaded), imported onto one process and several meshes, scored against transformers' own forward, and
written back bit for bit.

Tolerances: the import copies regions, so weights compare bitwise. Logits are float32 computations in
another order than transformers' (SDPA vs eager attention, q pre-scaled by the softmax scale, grouped
matmuls, tp's split matmuls and all-reduces, vocab-parallel softmax), so they agree to float32 round-off on
values of size ~1: 1e-5. The routers' weights are drawn large, so no token sits near a tie between experts.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from polyshard.checkpoint import CheckpointError
from polyshard.trainer.checkpointing.hugging_face import model_settings, write_hf
from tests.models._hf import (
    MESHES,
    ROUND_OFF,
    assert_imports_as_transformers,
)
from tests.models.test_hf import _tokens
from tests.models.test_hf_llama import _broken, _config

transformers = pytest.importorskip("transformers")

SIZES = {
    "vocab_size": 300, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
    "n_routed_experts": 8, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "qk_nope_head_dim": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "max_position_embeddings": 64,
}  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def _save(folder, model_type, **extra):
    t = transformers
    if model_type == "deepseek_v3":
        config = t.DeepseekV3Config(
            **SIZES, q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_parameters=YARN, **extra
        )
        model_class = t.DeepseekV3ForCausalLM
    else:
        config = t.DeepseekV2Config(**SIZES, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5)
        model_class = t.DeepseekV2ForCausalLM
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor count
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (1.0 if name.endswith(".gate.weight") else 0.05))  # decisive routers
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)  # the selection bias moves choices
    model.save_pretrained(folder)
    return folder


FAMILIES = ("deepseek_v3", "deepseek_v2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: _save(tmp_path_factory.mktemp(name), name) for name in FAMILIES}


# The default suite: one process for each family; `make test-long` the table (ep2 x tp2 and the rest).
QUICK = {("deepseek_v3", "one"), ("deepseek_v2", "one")}
LAYOUTS = [(f, m) for f in FAMILIES for m in MESHES]


@pytest.mark.parametrize(
    "family, mesh",
    [pytest.param(f, m, id=f"{f}-{m}", marks=() if (f, m) in QUICK else pytest.mark.long) for f, m in LAYOUTS],
)
def test_import_scores_as_transformers_on_any_mesh(distributed, folders, corpus, tmp_path, family, mesh):
    folder = folders[family]
    config = _config(folder, corpus, **MESHES[mesh])
    if config.parallel.cp > 1:  # cp splits whole contexts: the rows of _tokens(), 12 tokens (a run may choose it)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, context_length=12))
    assert_imports_as_transformers(distributed, f"{family} {mesh}", config, folder, tmp_path, losses=False)


def test_a_tied_head_imports_and_exports_as_transformers(distributed, corpus, tmp_path):
    """tie_word_embeddings (DeepSeek's releases untie it; a smaller model may not): model.tie_embeddings, the
    head read from the embedding, and an export that writes no lm_head, as transformers saves it."""
    folder = _save(tmp_path / "tied", "deepseek_v3", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    config = _config(folder, corpus)
    assert config.model.tie_embeddings
    assert_imports_as_transformers(distributed, "deepseek_v3 tied", config, folder, tmp_path, losses=False)


def test_the_settings_are_the_folders(folders, tmp_path):
    v3, v2 = model_settings(folders["deepseek_v3"]), model_settings(folders["deepseek_v2"])
    assert (v3["kind"], v3["q_lora_rank"], v3["moe.score"], v3["moe.groups"], v3["moe.scale"]) == (
        "deepseek-v3", 24, "sigmoid", 2, 2.5,
    )  # fmt: skip
    assert (v3["rope.factor"], v3["rope.mscale_all_dim"], v3["moe.dense_layers"]) == (4.0, 1.0, [0])
    assert (v2["moe.score"], v2["moe.renormalize"], "q_lora_rank" not in v2 or v2["q_lora_rank"] is None) == (
        "softmax", False, True,
    )  # fmt: skip
    # A written config.json reads back as the same settings.
    from polyshard.trainer.checkpointing.hugging_face import hf_config
    from polyshard.trainer.config import from_dict

    for folder in folders.values():
        model = from_dict({"model": model_settings(folder)}).model
        copy = tmp_path / folder.name
        copy.mkdir()
        (copy / "config.json").write_text(json.dumps(hf_config(model)))
        assert model_settings(copy) == model_settings(folder)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads must equal num_attention_heads=4"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic' is not supported"),
        ({"n_group": 3}, "n_group=3 does not divide n_routed_experts=8"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace=9 exceeds num_hidden_layers=3"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8' is not supported .* convert the folder"),
    ],
)
def test_a_folder_polyshard_cannot_compute_is_refused_by_name(folders, tmp_path, edit, message):
    folder = _broken(folders["deepseek_v3"], tmp_path, "broken", lambda hf: {**hf, **edit})
    with pytest.raises(CheckpointError, match=message):
        model_settings(folder)


def test_v2_group_limited_routing_is_refused(folders, tmp_path):
    grouped = {"topk_method": "group_limited_greedy"}
    folder = _broken(folders["deepseek_v2"], tmp_path, "broken", lambda hf: {**hf, **grouped})
    with pytest.raises(CheckpointError, match="topk_method='group_limited_greedy' is not supported"):
        model_settings(folder)


def test_each_ep_rank_reads_only_its_experts(folders, corpus):
    """An ep rank's region of a stacked expert tensor names only its experts' stored tensors."""
    from polyshard.trainer.checkpointing.hugging_face import HFSource

    folder = folders["deepseek_v3"]
    source = HFSource(folder, _config(folder, corpus, ep=2))
    key = "model/layers.2.mlp.moe.experts.w2"  # (E, F, H) from experts.<e>.down_proj.weight (H, F)
    assert source.global_shape(key) == (8, 16, 32)
    tensors = load_file(folder / "model.safetensors")
    rows = source.read(key, (4, 0, 0), (4, 16, 32), torch.float32)  # ep rank 1 of 2
    for e in range(4, 8):
        assert torch.equal(rows[e - 4], tensors[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].T)
    source.files["model.layers.1.mlp.experts.0.down_proj.weight"] = "nowhere.safetensors"  # never opened
    source.read(key, (4, 0, 0), (4, 16, 32), torch.float32)


def _train_from_hf(config, folder, out):
    from polyshard.mesh import Mesh
    from polyshard.trainer.loop import train

    return train(config, Mesh(config.parallel.mesh_axes), out, log=False, init_from=f"hf:{folder}").losses


@pytest.mark.long
def test_export_after_training_loads_in_transformers(distributed, folders, corpus, tmp_path):
    """Initialise from the folder, train 3 steps on ep2 with the selection bias moving, export: transformers
    loads the folder with nothing missing or unexpected, its logits are polyshard's, and the moved bias
    is the folder's e_score_correction_bias."""
    from polyshard.checkpoint import latest_checkpoint
    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.run_export import consolidate
    from polyshard.trainer.config import from_dict

    folder = folders["deepseek_v3"]
    base = _config(folder, corpus, ep=2)
    settings = {**model_settings(folder), "moe.bias_update_rate": 0.01}
    config = from_dict({"model": settings, "parallel": {"ep": 2}, "training": {"steps": 3, "global_batch_size": 4,
                        "eval_every": 0, "sample_tokens": 0}, "data": {"source": corpus},
                        "logging": {"progress_bar": False}})  # fmt: skip
    assert config.model.moe.score == base.model.moe.score == "sigmoid"
    distributed.run(2, _train_from_hf, config, folder, tmp_path / "run")
    state = consolidate(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    bias = "layers.2.mlp.moe.router.bias"
    original = load_file(folder / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert not torch.equal(state[bias], original)  # moved by the load
    out = write_hf(state, config.model, tmp_path / "hf-out")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.equal(loaded.model.layers[1].mlp.gate.e_score_correction_bias, state[bias])
    ours = build_model(config.model)
    ours.load_state_dict(state, strict=True)
    with torch.no_grad():
        theirs, mine = loaded.eval()(_tokens()[:, :-1]).logits, ours.eval()(_tokens()[:, :-1])
    torch.testing.assert_close(theirs, mine, rtol=ROUND_OFF, atol=ROUND_OFF)
