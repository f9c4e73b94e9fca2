"""Hugging Face Mixtral, Qwen2, Qwen3, Qwen3-MoE and Qwen2-MoE in and out. Tiny random models of each
(grouped query attention: 4 heads, 2 kv heads; 4 experts, top 2; Qwen3 with a head dim of its own, 16 on
a 32-wide stream, and tied embeddings; Qwen2 with q/k/v biases; Qwen3-MoE renormalising its top-k
weights; Qwen2-MoE with q/k/v biases and a gated shared expert) are built with `transformers`, saved with
save_pretrained (nothing is downloaded), imported onto one process, ep2, tp2, ep2 x tp2 and pp2, scored
against transformers' own forward, and written back in the Hugging Face format.

Tolerances: the import is a copy of regions, so weights compare bitwise. Logits and losses are float32
computations done in another order than transformers' (SDPA vs eager attention, grouped matmuls vs one
matmul per expert, tp's split matmuls and all-reduces, vocab-parallel softmax), so they agree to float32
round-off on values of size ~1: 1e-5. The routers' weights are drawn large, so no token sits near a tie
between two experts (which round-off could flip).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from polyshard.checkpoint import CheckpointError
from polyshard.mesh import Mesh
from polyshard.trainer.checkpointing.hugging_face import (
    HFSource,
    check_matches,
    hf_config,
    model_settings,
    write_hf,
)
from polyshard.trainer.config import from_dict
from tests.models._hf import (
    ROUND_OFF,
    assert_imports_as_transformers,
)
from tests.models.test_hf import _tokens
from tests.models.test_hf_llama import _broken, _config

transformers = pytest.importorskip("transformers")

SIZES = {
    "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 16,
}  # fmt: skip
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}


def _models():
    """model_type -> (config class, model class, the config's settings)."""
    t = transformers
    qwen3 = {"intermediate_size": 40, "head_dim": 16, "tie_word_embeddings": True}
    qwen2_moe = {**MOE, "num_experts": 4, "shared_expert_intermediate_size": 24}
    return {
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, {"intermediate_size": 24, "num_local_experts": 4}),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {"intermediate_size": 40}),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, qwen3),
        "qwen3_moe": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM, {**MOE, "num_experts": 4, "norm_topk_prob": True}),
        "qwen2_moe": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM, qwen2_moe),
        # Layers that differ: a dense first block 40 wide, then a sparse one (mlp_only_layers); and
        # decoder_sparse_step 2, which keeps block 0 dense too (block i is sparse when 2 divides i + 1).
        "qwen3_moe_dense": (
            t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM,
            {**MOE, "num_experts": 4, "norm_topk_prob": True, "mlp_only_layers": [0], "intermediate_size": 40},
        ),
        "qwen2_moe_step": (
            t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM, {**qwen2_moe, "decoder_sparse_step": 2, "intermediate_size": 40}
        ),
    }  # fmt: skip


def _save(folder, model_type):
    config_class, model_class, extra = _models()[model_type]
    torch.manual_seed(0)
    model = model_class(config_class(**SIZES, **extra, rms_norm_eps=1e-6))
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor count
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (1.0 if name.endswith(".gate.weight") else 0.02))  # decisive routers
    model.save_pretrained(folder)
    return folder


FAMILIES = ("mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "qwen3_moe_dense", "qwen2_moe_step")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: _save(tmp_path_factory.mktemp(name), name) for name in FAMILIES}


MESHES = {"one": {}, "ep2": {"ep": 2}, "tp2": {"tp": 2}, "ep2xtp2": {"ep": 2, "tp": 2}, "pp2": {"pp": 2}}
DENSE = ("qwen2", "qwen3")
LAYOUTS = [(family, mesh) for family in FAMILIES for mesh in MESHES if not (family in DENSE and "ep" in mesh)]
LAYOUTS += [("qwen3", "tp4")]  # 2 kv heads on 4 tp ranks: each k head (and its k norm) on two ranks
MESHES["tp4"] = {"tp": 4}
# The default suite keeps one process for every family and each kind of layout once; `make test-long` the table.
QUICK = {(family, "one") for family in FAMILIES} | {("qwen2_moe", "ep2xtp2"), ("qwen3", "tp2"), ("mixtral", "pp2")}
# The dense block on pp stage 0 and the sparse one on stage 1 (their costs split them so), and ep2 x tp2
# with a dense block that tp splits beside one whose experts ep splits.
QUICK |= {("qwen3_moe_dense", "pp2"), ("qwen2_moe_step", "ep2xtp2")}


@pytest.mark.parametrize(
    "family, mesh",
    [pytest.param(f, m, id=f"{f}-{m}", marks=() if (f, m) in QUICK else pytest.mark.long) for f, m in LAYOUTS],
)
def test_import_lays_the_family_out_on_any_mesh(distributed, folders, corpus, tmp_path, family, mesh):
    folder = folders[family]
    config = _config(folder, corpus, **MESHES[mesh])
    assert_imports_as_transformers(distributed, f"{family} {mesh}", config, folder, tmp_path)


def test_each_rank_reads_only_its_experts(folders, corpus):
    """An ep rank's region of a stacked expert tensor names only its experts' stored tensors: a folder
    whose other experts are unreadable still gives this rank's rows."""
    folder = folders["qwen3_moe"]
    source = HFSource(folder, _config(folder, corpus))
    key = "model/layers.1.mlp.moe.experts.w2"  # (E, F, H) from experts.<e>.down_proj.weight (H, F)
    assert source.global_shape(key) == (4, 16, 32)
    tensors = load_file(folder / "model.safetensors")
    rows = source.read(key, (2, 0, 0), (2, 16, 32), torch.float32)  # ep rank 1 of 2
    for e in (2, 3):
        assert torch.equal(rows[e - 2], tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].T)
    source.files["model.layers.0.mlp.experts.0.down_proj.weight"] = "nowhere.safetensors"  # never opened
    source.read(key, (2, 0, 0), (2, 16, 32), torch.float32)


def test_the_settings_are_the_folders(folders):
    mixtral, qwen3 = model_settings(folders["mixtral"]), model_settings(folders["qwen3"])
    qwen3_moe, qwen2_moe = model_settings(folders["qwen3_moe"]), model_settings(folders["qwen2_moe"])
    assert (mixtral["kind"], mixtral["moe.ffn_hidden"], mixtral["moe.renormalize"]) == ("moe-gpt", 24, True)
    assert mixtral["rope.theta"] == 1e6  # MixtralConfig's default base
    assert (qwen3["kind"], qwen3["head_dim"], qwen3["qk_norm"], qwen3["tie_embeddings"]) == ("gpt", 16, True, True)
    assert (qwen3_moe["qk_norm"], qwen3_moe["moe.renormalize"], qwen3_moe["moe.num_experts"]) == (True, True, 4)
    shared = (qwen2_moe["moe.shared_experts"], qwen2_moe["moe.shared_ffn_hidden"], qwen2_moe["moe.shared_gate"])
    assert shared == (1, 24, True)
    assert (qwen2_moe["qkv_bias"], qwen2_moe["bias"], qwen2_moe["moe.renormalize"]) == (True, False, False)
    qwen2 = model_settings(folders["qwen2"])
    assert (qwen2["kind"], qwen2["qkv_bias"], qwen2["bias"], qwen2["qk_norm"]) == ("gpt", True, False, False)
    assert "moe.dense_layers" not in qwen3_moe  # every block sparse: nothing to say
    for name in ("qwen3_moe_dense", "qwen2_moe_step"):
        dense = model_settings(folders[name])
        assert (dense["moe.dense_layers"], dense["moe.dense_ffn_hidden"]) == ([0], 40)


def _train_from_hf(config, folder, out):
    from polyshard.trainer.loop import train

    return train(config, Mesh(config.parallel.mesh_axes), out, log=False, init_from=f"hf:{folder}").losses


@pytest.mark.parametrize(
    "family, mesh",
    [
        pytest.param("qwen2_moe", {"ep": 2, "tp": 2}, id="qwen2_moe-ep2xtp2"),
        pytest.param("qwen3", {"tp": 2}, id="qwen3-tp2"),
        pytest.param("mixtral", {"ep": 2, "pp": 2}, id="mixtral-ep2xpp2", marks=pytest.mark.long),
        pytest.param("qwen3_moe", {"ep": 2}, id="qwen3_moe-ep2", marks=pytest.mark.long),
        # A dense block on stage 0, the experts on stage 1 split over ep; exported as decoder_sparse_step's.
        pytest.param("qwen2_moe_step", {"ep": 2, "pp": 2}, id="qwen2_moe_step-ep2xpp2", marks=pytest.mark.long),
    ],
)
def test_export_after_training_loads_in_transformers(distributed, folders, corpus, tmp_path, family, mesh):
    """Initialise from the folder, train a few steps, export: transformers loads the folder with no
    missing or unexpected keys, and its logits are polyshard's."""
    from polyshard.checkpoint import latest_checkpoint
    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.run_export import consolidate

    folder = folders[family]
    config = _config(folder, corpus, **mesh)
    losses = distributed.run(config.parallel.world_size, _train_from_hf, config, folder, tmp_path / "run")
    assert all(loss == losses[0] for loss in losses)
    state = consolidate(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert not torch.equal(state["layers.0.tok.weight"], load_file(folder / "model.safetensors")[_EMBED])  # trained
    out = write_hf(state, config.model, tmp_path / "hf-out")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = build_model(config.model)
    ours.load_state_dict(state, strict=True)
    with torch.no_grad():
        theirs, mine = loaded.eval()(_tokens()[:, :-1]).logits, ours.eval()(_tokens()[:, :-1])
    print(f"{family} trained, exported: max |logit - transformers'| = {(theirs - mine).abs().max():.3g}")
    torch.testing.assert_close(theirs, mine, rtol=ROUND_OFF, atol=ROUND_OFF)
    assert model_settings(out) == model_settings(folder)


_EMBED = "model.embed_tokens.weight"


@pytest.mark.parametrize(
    "family, edit, message",
    [
        ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an integer >= 1"),
        ("qwen3_moe", {"mlp_only_layers": [2]}, r"mlp_only_layers=\[2\] names blocks \[2\] outside 0..1"),
        ("qwen3_moe", {"mlp_only_layers": "0"}, "mlp_only_layers='0' must be a list of block indices"),
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
        ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
        ("mixtral", {"sliding_window": 4096}, "sliding_window=4096 is not supported"),
        ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
        ("qwen2_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob='yes' must be true or false"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0 must be an integer"),
        ("qwen3", {"head_dim": 7}, "head_dim=7 must be even"),
    ],
)  # fmt: skip
def test_an_unsupported_config_is_refused_naming_the_key(folders, tmp_path, family, edit, message):
    copy = _broken(folders[family], tmp_path, "edited", config_edit=lambda hf: {**hf, **edit})
    with pytest.raises(CheckpointError, match=message):
        model_settings(copy)


def test_a_missing_expert_is_named_and_the_cli_exits_2(folders, corpus, tmp_path):
    from polyshard.cli.main import app

    folder = folders["mixtral"]
    expert = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    broken = _broken(folder, tmp_path, "broken", tensors_edit=lambda t: {k: v for k, v in t.items() if k != expert})
    with pytest.raises(CheckpointError, match=rf"Mixtral these settings describe: missing \['{expert}'\]"):
        HFSource(broken, _config(folder, corpus))
    # Through the command line: one line naming the tensor, exit 2, before any process starts.
    toml = "[model]\n" + "".join(f"{_key(k)} = {json.dumps(v)}\n" for k, v in model_settings(folder).items())
    toml += f"[training]\nsteps = 2\nglobal_batch_size = 4\n[data]\nsource = {json.dumps(corpus)}\n"
    (tmp_path / "c.toml").write_text(toml)
    run = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", str(tmp_path / "c.toml"), "--out", str(run), "--init-from", f"hf:{broken}"]
    )
    assert result.exit_code == 2 and expert in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1 and not run.exists()


def test_a_model_is_exported_as_the_family_it_has(folders, corpus):
    qwen2 = _config(folders["qwen2_moe"], corpus).model
    assert hf_config(qwen2)["architectures"] == ["Qwen2MoeForCausalLM"]
    ungated = from_dict({"model": {**model_settings(folders["qwen2_moe"]), "moe.shared_gate": False}}).model
    with pytest.raises(CheckpointError, match="Qwen2-MoE would need moe.shared_gate=True"):
        hf_config(ungated)
    normed = from_dict({"model": {**model_settings(folders["mixtral"]), "qk_norm": True}}).model
    assert hf_config(normed)["architectures"] == ["Qwen3MoeForCausalLM"]  # q/k norms, no shared expert
    # Mixtral always renormalises: without it the same model is Qwen3-MoE's only with q/k norms.
    raw = from_dict({"model": {**model_settings(folders["mixtral"]), "moe.renormalize": False}}).model
    with pytest.raises(CheckpointError, match="Mixtral would need moe.renormalize=True; Qwen3-MoE would need qk_"):
        hf_config(raw)
    # The folder's settings are what a run must use, named as --set fixes.
    other = from_dict({"model": {**model_settings(folders["qwen3_moe"]), "moe.ffn_hidden": 32}}).model
    with pytest.raises(CheckpointError, match="--set model.moe.ffn_hidden=16"):
        check_matches(folders["qwen3_moe"], other)


# Totals the model cards give: Mixtral-8x7B 46.7B (46,702,792,704), Qwen3-30B-A3B 30.5B, Qwen3-8B 8.2B.
@pytest.mark.parametrize(
    "preset, architecture, parameters",
    [
        ("qwen3-tiny", "Qwen3ForCausalLM", None),
        ("mixtral-tiny", "MixtralForCausalLM", None),
        ("qwen3-moe-tiny", "Qwen3MoeForCausalLM", None),
        ("qwen2-moe-tiny", "Qwen2MoeForCausalLM", None),
        ("qwen3-8b", "Qwen3ForCausalLM", 8_190_735_360),
        ("mixtral-8x7b", "MixtralForCausalLM", 46_702_792_704),
        ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30_532_122_624),
    ],
)
def test_the_presets_are_the_families(preset, architecture, parameters):
    """Each preset exports as its family; transformers builds the same number of parameters from the
    config.json polyshard writes (on the meta device for the large ones: nothing allocated)."""
    from polyshard.models import parameter_count

    model = from_dict({"model": {"preset": preset}}).model
    hf = hf_config(model)
    assert hf["architectures"] == [architecture]
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in theirs.parameters()) == parameter_count(model)
    if parameters is not None:
        assert parameter_count(model) == parameters


def test_a_sigmoid_or_grouped_router_is_not_exported_as_a_softmax_family():
    # Mixtral and Qwen-MoE route with softmax top-k over all experts: a model trained with DeepSeek's
    # biased sigmoid router or group-limited choice would load there and compute something else.
    from polyshard.checkpoint import CheckpointError
    from polyshard.trainer.checkpointing.hugging_face import hf_config
    from polyshard.trainer.config import from_dict

    mixtral = {"kind": "moe-gpt", "preset": "mixtral-tiny"}
    assert hf_config(from_dict({"model": mixtral}).model)["model_type"] == "mixtral"
    for routing in ({"moe": {"score": "sigmoid"}}, {"moe": {"groups": 2, "group_topk": 2}}):
        with pytest.raises(CheckpointError, match="moe.score|moe.groups"):
            hf_config(from_dict({"model": {**mixtral, **routing}}).model)


def _key(name: str) -> str:
    """A settings key as a TOML key: moe.top_k is the dotted key of [model.moe]."""
    return ".".join(f'"{part}"' if not part.replace("_", "").isalnum() else part for part in name.split("."))
