"""gpt-oss: a tiny random ``GptOssForCausalLM`` (4 heads on 2 kv heads, non-zero sinks, a 4-token window in
its sliding block and a full block after it, YaRN rotary scaling, biased q/k/v/o, 4 biased experts with the
clamped SwiGLU, a biased top-2 router) built with `transformers` and saved with save_pretrained (nothing is
downloaded), imported onto one process, tp2, ep2, pp2, cp2 (ring, the window crossing chunks) and ep2 x tp2,
scored against transformers' own forward, and written back bit for bit; the parameter counts of the released
sizes against transformers' on the meta device; the refusals, each naming its key.

Tolerances: the import is a copy of regions, so weights compare bitwise. Logits and losses are float32
computations done in another order than transformers' (online-softmax attention blocks vs eager attention,
grouped matmuls vs one matmul per expert, tp's split matmuls and all-reduces, the ring's log-sum-exp merges,
vocab-parallel softmax): float32 round-off on values of size ~1, 1e-5. The routers' weights are drawn large,
so no token sits near a tie between two experts (which round-off could flip).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from polyshard.checkpoint import CheckpointError
from polyshard.trainer.checkpointing.hugging_face import HFSource, model_settings, write_hf
from polyshard.trainer.config import from_dict
from tests.models._hf import (
    MESHES,
    assert_imports_as_transformers,
)
from tests.models.test_hf_llama import _broken, _config

transformers = pytest.importorskip("transformers")

ROPE = {
    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 4,
}  # fmt: skip
SIZES = {
    "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
    "max_position_embeddings": 12, "rope_parameters": ROPE,  # the rows of _tokens(): cp splits whole contexts
}  # fmt: skip


def _save(folder):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SIZES))
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor count
        for name, p in model.named_parameters():
            scale = 1.0 if ".router." in name else 0.5 if name.endswith("sinks") else 0.02
            p.add_(torch.randn_like(p) * scale)  # decisive routers, sinks that take a share of each softmax
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("gpt_oss"))


# The default suite keeps one process and cp2 (windows under the ring); `make test-long` the rest.
QUICK = {"one", "cp2"}


@pytest.mark.parametrize("mesh", [pytest.param(m, marks=() if m in QUICK else pytest.mark.long) for m in MESHES])
def test_import_scores_as_transformers_on_any_mesh(distributed, folder, corpus, tmp_path, mesh):
    config = _config(folder, corpus, **MESHES[mesh])
    assert_imports_as_transformers(distributed, f"gpt-oss {mesh}", config, folder, tmp_path)


def test_the_settings_are_the_folders(folder, tmp_path):
    settings = model_settings(folder)
    assert settings["kind"] == "gpt-oss" and settings["layer_types"] == ["sliding_attention", "full_attention"]
    assert (settings["sliding_window"], settings["rope.scaling"], settings["rope.factor"]) == (4, "yarn", 4.0)
    assert (settings["moe.ffn_hidden"], settings["moe.num_experts"], settings["moe.top_k"]) == (24, 4, 2)
    assert settings["moe.aux_loss_coef"] == 0.0  # transformers trains without it unless output_router_logits
    model = from_dict({"model": settings}).model
    out = write_hf(_weights(folder, model), model, tmp_path / "again")
    written = json.loads((out / "config.json").read_text())
    assert written["rope_parameters"] == ROPE and written["model_type"] == "gpt_oss"
    assert model_settings(out) == settings
    # gpt-oss's config.json cannot say a block is dense: such a model is refused, not written without it
    dense = from_dict({"model": {**settings, "moe.dense_layers": [0]}}).model
    with pytest.raises(CheckpointError, match=r"moe.dense_layers"):
        write_hf(_weights(folder, model), dense, tmp_path / "dense")


def _weights(folder, model):
    from polyshard.models.gpt_oss.hf import locations

    tensors = load_file(folder / "model.safetensors")
    return {ours: tensors[where.name] for ours, where in locations(model).items()}


def test_each_rank_reads_only_its_experts(folder, corpus):
    source = HFSource(folder, _config(folder, corpus, ep=2))
    tensors = load_file(folder / "model.safetensors")
    for ours, theirs in (("experts.w1", "experts.gate_up_proj"), ("experts.w2_bias", "experts.down_proj_bias")):
        key, stored = f"model/layers.1.mlp.moe.{ours}", tensors[f"model.layers.0.mlp.{theirs}"]
        shape = source.global_shape(key)
        rows = source.read(key, (2, *(0,) * (len(shape) - 1)), (2, *shape[1:]), torch.float32)  # ep rank 1
        assert torch.equal(rows, stored[2:])


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method=.bitsandbytes. is not supported"),
        ({"rope_parameters": {**ROPE, "rope_type": "longrope"}}, "rope_type='longrope' is not supported"),
        ({"layer_types": ["sliding_attention"]}, "layer_types=.* must name each of the 2 layers"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
        ({"swiglu_limit": -1.0}, "swiglu_limit=-1.0 must be a finite number > 0"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
)  # fmt: skip
def test_refusals_name_the_key(folder, tmp_path, edit, message):
    broken = _broken(folder, tmp_path, "broken", config_edit=lambda hf: {**hf, **edit})
    with pytest.raises(CheckpointError, match=message):
        model_settings(broken)


@pytest.mark.parametrize("preset, layers, experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_presets_have_transformers_parameter_counts(preset, layers, experts):
    """20.9B and 116.8B parameters, as transformers' models built on the meta device."""
    from polyshard.models import build_model

    with torch.device("meta"):
        theirs = transformers.GptOssForCausalLM(
            transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
        )
    model = from_dict({"model": {"preset": preset}}).model
    ours = build_model(model, layers=())  # every layer left on the meta device: shapes only
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    assert model.layer_types == transformers.GptOssConfig(num_hidden_layers=layers).layer_types


def test_mxfp4_experts_are_dequantized_on_import(folder, corpus, tmp_path):
    """A folder whose experts' gate_up_proj are MXFP4 blocks and scales (as OpenAI's releases store them;
    random codes and scales here) reads as transformers' own dequantization of them, bit for bit, and an
    ep rank's region decodes only its experts' rows."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    packed, expected = {}, {}
    for layer in (0, 1):
        name = f"model.layers.{layer}.mlp.experts.gate_up_proj"
        blocks = torch.randint(0, 256, (4, 48, 1, 16), dtype=torch.uint8, generator=g)  # (E, 2F, H/32, 16)
        scales = torch.randint(120, 130, (4, 48, 1), dtype=torch.uint8, generator=g)  # 2^-7 .. 2^2
        packed |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        expected[layer] = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, H, 2F)

    def quantize(tensors):
        return {k: v for k, v in tensors.items() if not k.endswith("gate_up_proj")} | packed

    def mark(hf):
        return {**hf, "quantization_config": {"quant_method": "mxfp4"}}

    quantized = _broken(folder, tmp_path, "mxfp4", config_edit=mark, tensors_edit=quantize)
    config = _config(quantized, corpus, ep=2)
    source = HFSource(quantized, config)
    for layer in (0, 1):
        key = f"model/layers.{layer + 1}.mlp.moe.experts.w1"
        assert source.global_shape(key) == (4, 32, 48)
        assert torch.equal(source.read(key, (0, 0, 0), (4, 32, 48), torch.float32), expected[layer])
        rank_1 = source.read(key, (2, 8, 0), (2, 8, 48), torch.float32)  # ep rank 1's experts, a row slice
        assert torch.equal(rank_1, expected[layer][2:, 8:16])
    assert model_settings(quantized) == model_settings(folder)
