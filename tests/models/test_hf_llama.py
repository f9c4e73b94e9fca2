"""Hugging Face Llama in and out. Tiny random Llamas (grouped-query attention: 4 heads, 2 key/value
heads; tied and untied; one with Llama 3.1's rope scaling) are built with `transformers`, saved with
save_pretrained (nothing is downloaded), imported onto several meshes, scored against transformers'
own forward, and written back in the Hugging Face format.

Tolerances: the import itself is a copy of regions, so weights compare bitwise. Logits and losses
are float32 computations done in another order than transformers' (SDPA vs eager attention, GQA by
broadcast vs repeated heads, tp's split matmuls and all-reduces, vocab-parallel softmax), so they
agree to float32 round-off on values of size ~1: 1e-5.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyshard.checkpoint import CheckpointError
from polyshard.mesh import Mesh
from polyshard.models.gpt.hf_llama import settings as llama_settings
from polyshard.trainer.checkpointing.hugging_face import (
    HFSource,
    check_matches,
    hf_config,
    hf_state,
    model_settings,
    write_hf,
)
from polyshard.trainer.config import from_dict
from tests.models._hf import (
    ROUND_OFF,
    assert_imports_as_transformers,
)
from tests.models.test_hf import _asdict, _tokens

transformers = pytest.importorskip("transformers")

VOCAB = 300  # _tokens() draws from 300 tokens
# Head dim 16 with theta 10000 gives wavelengths 6.3, 20, 63, 200, ...: with an original context of
# 32 (bands at 32/4 = 8 and 32/1 = 32) the scaled Llama has frequencies kept, blended and divided.
SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}  # fmt: skip


def _save_llama(folder, *, tie: bool, scaled: bool = False, layers: int = 2):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=88, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64 if scaled else 16, rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        rope_parameters={"rope_theta": 10000.0, **SCALING} if scaled else {"rope_type": "default", "rope_theta": 5e5},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms start at 1: make every tensor count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder)
    return folder


FOLDERS = {"tied": {"tie": True}, "untied": {"tie": False}, "scaled": {"tie": True, "scaled": True}}
FOLDERS["untied-3"] = {"tie": False, "layers": 3}  # 5 pipeline layers: 3 stages cannot split them evenly


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: _save_llama(tmp_path_factory.mktemp(name), **kw) for name, kw in FOLDERS.items()}


def _config(folder, corpus, **parallel):
    return from_dict(
        {
            "model": model_settings(folder),
            "parallel": parallel,
            "training": {"steps": 3, "global_batch_size": 4},
            "eval": {"every": 0, "sample_tokens": 0},
            "data": {"source": corpus},
            "logging": {"progress_bar": False},
        }
    )


def _import_and_score(config, folder, out):
    """On each rank: import, then (this data rank's logits, whole along the sequence, the mean loss) and a
    checkpoint. Under cp each rank's logits are its chunks, put back in order over the cp group."""
    from polyshard.checkpoint import save_checkpoint
    from polyshard.cp import unshard_sequence
    from polyshard.trainer.checkpointing.run_reshard import load_into
    from polyshard.trainer.checkpointing.state import state_tensors
    from polyshard.trainer.engine.builder import build_engine
    from polyshard.trainer.loop import evaluate_batches

    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    load_into(engine, HFSource(folder, config))
    data_rank = mesh.group_rank(("dp", "ep"))
    part = _tokens().chunk(config.parallel.dp * config.parallel.ep)[data_rank]
    for stage in engine.stages.values():
        stage.eval()
    logits = engine.forward_only(engine.local_tokens(part[:, :-1]), lambda y: y.clone())
    if logits is not None and config.parallel.cp > 1:
        logits = unshard_sequence(logits, 1, mesh.group("cp"))
    loss, _ = evaluate_batches(engine, [(part[:, :-1], part[:, 1:])])
    save_checkpoint(out, 0, state_tensors(engine), mesh_axes=config.parallel.mesh_axes, config=_asdict(config))
    return loss, (data_rank, mesh.coord("tp"), logits if mesh.coord("cp") == 0 else None)


def _whole_logits(pieces, vocab):
    """(data rank, tp rank, local logits) from every rank -> the (B, S, V) logits: tp shards side by side
    along the vocabulary (padding cut), data ranks' parts stacked along the batch."""
    shards: dict[int, dict[int, torch.Tensor]] = {}
    for data_rank, tp_rank, logits in pieces:
        if logits is not None:
            shards.setdefault(data_rank, {})[tp_rank] = logits
    parts = [torch.cat([tp[r] for r in sorted(tp)], dim=-1)[..., :vocab] for _, tp in sorted(shards.items())]
    return torch.cat(parts, dim=0)


LAYOUTS = {
    "one": ("tied", {}),
    "untied-one": ("untied", {}),
    "tp2": ("tied", {"tp": 2}),
    "pp2": ("untied", {"pp": 2}),
    "dp2xtp2": ("tied", {"dp": 2, "tp": 2}),
    "tp2xpp2": ("untied", {"tp": 2, "pp": 2}),  # the head's own weight, vocab-parallel on the last stage
    "tied-tp2xpp2": ("tied", {"tp": 2, "pp": 2}),  # the tied weight on both end stages
    "pp3-uneven": ("untied-3", {"pp": 3}),
    "scaled-one": ("scaled", {}),
    "scaled-tp2": ("scaled", {"tp": 2}),
}


# The default suite keeps one of each kind of layout; `make test-long` (CI) runs them all.
QUICK = {"one", "tp2", "tied-tp2xpp2", "pp3-uneven", "scaled-tp2"}


@pytest.mark.parametrize(
    "layout", [name if name in QUICK else pytest.param(name, marks=pytest.mark.long) for name in LAYOUTS]
)
def test_import_lays_llama_out_on_any_mesh(distributed, folders, corpus, tmp_path, layout):
    name, parallel = LAYOUTS[layout]
    folder = folders[name]
    config = _config(folder, corpus, **parallel)
    assert_imports_as_transformers(distributed, layout, config, folder, tmp_path, streamed=False)


def test_the_settings_are_the_folders(folders):
    tied, scaled = model_settings(folders["tied"]), model_settings(folders["scaled"])
    assert tied["norm"] == "rms" and tied["activation"] == "swiglu" and tied["positions"] == "rope"
    assert (tied["num_kv_heads"], tied["mlp_hidden"], tied["norm_eps"], tied["rope.theta"]) == (2, 88, 1e-6, 5e5)
    assert (tied["rope.scaling"], tied["rope.factor"]) == ("none", 1.0) and "rope.original_context" not in tied
    assert (scaled["rope.factor"], scaled["rope.original_context"], scaled["rope.theta"]) == (8.0, 32, 1e4)
    # A config.json in transformers 4's spelling (rope_theta and rope_scaling at the top) reads the same.
    hf = json.loads((folders["scaled"] / "config.json").read_text())
    parameters = hf.pop("rope_parameters")
    old = {**hf, "rope_theta": parameters.pop("rope_theta"), "rope_scaling": parameters}
    read = llama_settings(old, "config.json")
    assert {key: value for key, value in read.items() if value is not None} == scaled  # unset: left out


def test_export_after_training_loads_in_transformers(distributed, folders, corpus, tmp_path):
    """Initialise from the scaled Llama on tp2, train a few steps, export: transformers loads the folder
    with no missing or unexpected keys, and its logits are polyshard's."""
    from polyshard.checkpoint import latest_checkpoint
    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.run_export import consolidate

    folder = folders["scaled"]
    config = _config(folder, corpus, tp=2)
    distributed.run(2, _train_from_hf, config, folder, tmp_path / "run")
    state = consolidate(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert not torch.equal(state["layers.0.tok.weight"], load_file(folder / "model.safetensors")[_EMBED])  # trained
    out = write_hf(state, config.model, tmp_path / "hf-out")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["rope_scaling"]["factor"] == 8.0
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = build_model(config.model)
    ours.load_state_dict(state, strict=True)
    with torch.no_grad():
        theirs, mine = loaded.eval()(_tokens()[:, :-1]).logits, ours.eval()(_tokens()[:, :-1])
    print(f"trained, exported: max |logit - transformers'| = {(theirs - mine).abs().max():.3g}")
    torch.testing.assert_close(theirs, mine, rtol=ROUND_OFF, atol=ROUND_OFF)
    assert model_settings(out) == model_settings(folder)


_EMBED = "model.embed_tokens.weight"


def _train_from_hf(config, folder, out):
    from polyshard.trainer.loop import train

    return train(config, Mesh(config.parallel.mesh_axes), out, log=False, init_from=f"hf:{folder}").losses


def _broken(folder, tmp_path, name, config_edit=None, tensors_edit=None):
    """A copy of ``folder`` with its config.json and tensors edited."""
    copy = tmp_path / name
    copy.mkdir()
    hf = json.loads((folder / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config_edit(hf) if config_edit else hf))
    tensors = load_file(folder / "model.safetensors")
    save_file(tensors_edit(tensors) if tensors_edit else tensors, str(copy / "model.safetensors"))
    return copy


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6' must be a finite number"),
        ({"vocab_size": True}, "vocab_size=True must be an integer >= 1"),
        ({"hidden_size": None}, "hidden_size is missing"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type='yarn' is not supp"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1, "high_freq_factor": 4}},
         "factor=0.5 must be >= 1"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1}},
         "high_freq_factor=1 must be a finite number > 4.0"),
        ({"rope_parameters": {"rope_theta": 1e4, "mscale": 2}}, r"rope_parameters holds \['mscale'\]"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ],
)  # fmt: skip
def test_an_unsupported_config_is_refused_naming_the_key(folders, tmp_path, edit, message):
    copy = _broken(folders["tied"], tmp_path, "edited", config_edit=lambda hf: {**hf, **edit})
    with pytest.raises(CheckpointError, match=message):
        model_settings(copy)


def test_a_folder_that_does_not_fit_is_refused_naming_what(folders, corpus, tmp_path):
    config = _config(folders["tied"], corpus)
    # Other settings: every --set that would make them the folder's, a shorter context is fine.
    model = {**_asdict(config)["model"], "num_kv_heads": 4, "norm_eps": 1e-5, "positions": "learned"}
    other = from_dict({"model": {**model, "context_length": 8}}).model
    with pytest.raises(
        CheckpointError, match='--set model.positions="rope" --set model.num_kv_heads=2 --set model.norm_eps=1e-06'
    ):
        check_matches(folders["tied"], other)
    check_matches(folders["tied"], from_dict({"model": {**_asdict(config)["model"], "context_length": 8}}).model)
    longer = from_dict({"model": {**_asdict(config)["model"], "context_length": 32}}).model
    with pytest.raises(CheckpointError, match=r"--set model.context_length=16 \(or less\)"):
        check_matches(folders["tied"], longer)
    settings = _asdict(config)["model"]
    scaled = {**settings["rope"], "scaling": "llama3", "factor": 8.0}
    unscaled = from_dict({"model": {**settings, "rope": scaled}}).model
    with pytest.raises(CheckpointError, match='--set model.rope.scaling="none" --set model.rope.factor=1.0'):
        check_matches(folders["tied"], unscaled)
    # A missing tensor and a stray one are both named; the tied head's weight is not needed.
    layer = "model.layers.1"

    def edit(tensors):
        tensors.pop(f"{layer}.mlp.up_proj.weight")
        tensors[f"{layer}.self_attn.q_proj.bias"] = torch.zeros(64)
        return tensors

    broken = _broken(folders["tied"], tmp_path, "broken", tensors_edit=edit)
    with pytest.raises(
        CheckpointError,
        match=rf"Llama these settings describe: missing \['{layer}.mlp.up_proj.weight'\], "
        rf"unexpected \['{layer}.self_attn.q_proj.bias'\]",
    ):
        HFSource(broken, config)
    untied = _config(folders["untied"], corpus)
    headless = _broken(folders["untied"], tmp_path, "headless", tensors_edit=lambda t: _without(t, "lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing \['lm_head.weight'\]"):
        HFSource(headless, untied)
    wrong_shape = _broken(
        folders["tied"], tmp_path, "wide", tensors_edit=lambda t: {**t, "model.norm.weight": torch.ones(65)}
    )
    with pytest.raises(CheckpointError, match="model.norm.weight is \\[65\\].*config.json and the weights disagree"):
        HFSource(wrong_shape, config)


def _without(tensors, name):
    return {k: v for k, v in tensors.items() if k != name}


def test_a_base_model_file_reads_like_the_causal_lm(folders, corpus, tmp_path):
    """LlamaModel's names (embed_tokens, layers, norm: no "model.") read as LlamaForCausalLM's; the
    buffers transformers before 4.31 saved (rotary_emb.inv_freq) are skipped."""

    def edit(tensors):
        bare = {k.removeprefix("model."): v for k, v in tensors.items()}
        bare["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        return bare

    bare = _broken(folders["tied"], tmp_path, "bare", tensors_edit=edit)
    config = _config(folders["tied"], corpus)
    whole, base = HFSource(folders["tied"], config), HFSource(bare, config)
    for name in whole.locations:
        shape = whole.global_shape("model/" + name)
        assert torch.equal(base.read("model/" + name, (0,) * len(shape), shape, torch.float32),
                           whole.read("model/" + name, (0,) * len(shape), shape, torch.float32))  # fmt: skip


def test_only_gpt2_and_llama_shaped_models_are_exported(tmp_path):
    mix = from_dict({"model": {"norm": "rms", "activation": "gelu", "bias": False}}).model
    with pytest.raises(CheckpointError, match="none of them: GPT-2 would need norm='layer', bias=True; Llama would"):
        hf_config(mix)
    with pytest.raises(CheckpointError, match="none of them"):
        write_hf({}, mix, tmp_path / "out")
    moe = from_dict({"model": {"kind": "moe-gpt"}}).model  # GPT-2's blocks with experts: no family has them
    with pytest.raises(CheckpointError, match="writes Mixtral and Qwen3-MoE and Qwen2-MoE models of model.kind='m"):
        hf_state({}, moe)
    vit = from_dict({"model": {"kind": "vit", "hidden": 32, "num_heads": 4}}).model
    with pytest.raises(CheckpointError, match="model.kind='vit' has no Hugging Face counterpart"):
        hf_state({}, vit)
    gqa = from_dict({"model": {"num_kv_heads": 2}}).model
    with pytest.raises(CheckpointError, match="GPT-2 would need num_kv_heads=4"):
        hf_config(gqa)
    llama = hf_config(from_dict({"model": {"preset": "llama-3.2-1b"}}).model)
    assert llama["rope_scaling"] == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    assert llama["tie_word_embeddings"] is True and llama["num_key_value_heads"] == 8 and llama["head_dim"] == 64
    assert hf_config(from_dict({"model": {"preset": "llama-3-8b"}}).model)["rope_scaling"] is None
