"""model.init: GPT-2's rule and the depth-scaled rule torchtitan and Megatron-LM train Llama with."""

import math

import pytest
import torch

from polyshard.models import build_model
from polyshard.models.gpt.presets import PRESETS as GPT_PRESETS
from polyshard.models.moe_gpt.presets import PRESETS as MOE_PRESETS
from polyshard.trainer.config import from_dict
from polyshard.trainer.errors import ConfigError

PRESETS = {**GPT_PRESETS, **MOE_PRESETS}


def ModelConfig(**model):  # noqa: N802  (reads like the config it builds)
    """The family config a ``[model]`` table with these keys gives."""
    return from_dict({"model": model}).model


WIDE = {**PRESETS["llama-tiny"], "hidden": 256, "num_heads": 4, "num_kv_heads": 2, "mlp_hidden": 512,
        "vocab_size": 1024}  # fmt: skip


def _std(model: torch.nn.Module, name: str) -> float:
    return float(model.get_parameter(name).detach().std())


def test_the_rule_follows_the_architecture_unless_named():
    assert ModelConfig().init_rule == "gpt2"  # GPT-2: LayerNorm
    assert ModelConfig(**PRESETS["llama-tiny"]).init_rule == "depth"
    assert ModelConfig(**PRESETS["llama-tiny"], init="gpt2").init_rule == "gpt2"
    assert ModelConfig(kind="vit").init_rule == "gpt2"
    with pytest.raises(ConfigError, match="model.init='xavier'; choose one of"):
        ModelConfig(init="xavier")
    with pytest.raises(ConfigError, match="model.init is not a setting of model.kind='vit'"):
        ModelConfig(kind="vit", init="depth")


def test_depth_rule_scales_embedding_blocks_and_head():
    model = build_model(ModelConfig(**WIDE), seed=1)
    layers = WIDE["num_layers"]
    # Sampling error of a std over >= 64K draws is < 1%; the truncation at 3 sigma lowers it by 1.3%: 5% is loose.
    assert _std(model, "layers.0.tok.weight") == pytest.approx(1.0, rel=0.05)
    assert _std(model, f"layers.{layers + 1}.proj.weight") == pytest.approx(256**-0.5, rel=0.05)
    for depth in range(1, layers + 1):
        scaled = 0.02 / math.sqrt(2 * depth)
        for name in ("attn.o_proj", "mlp.down_proj", "mlp.up_proj"):
            assert _std(model, f"layers.{depth}.{name}.weight") == pytest.approx(scaled, rel=0.05), (depth, name)
        for name in ("attn.q_proj", "attn.k_proj", "mlp.gate_proj"):
            assert _std(model, f"layers.{depth}.{name}.weight") == pytest.approx(0.02, rel=0.05), (depth, name)
        assert bool((model.get_parameter(f"layers.{depth}.norm1.weight") == 1).all())
    head = model.get_parameter(f"layers.{layers + 1}.proj.weight")
    assert float(head.abs().max()) <= 3 * 256**-0.5  # truncated at 3 standard deviations
    tied = build_model(ModelConfig(**WIDE, tie_embeddings=True), seed=1)  # the embedding is the head: its scale
    assert _std(tied, "layers.0.tok.weight") == pytest.approx(256**-0.5, rel=0.05)


def test_gpt2_rule_is_unchanged_and_moe_layers_take_the_depth_rule():
    model = build_model(ModelConfig(), seed=0)
    assert _std(model, "layers.1.attn.o_proj.weight") == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert _std(model, "layers.0.tok.weight") == pytest.approx(0.02, rel=0.1)
    moe = build_model(ModelConfig(**PRESETS["mixtral-tiny"]), seed=0)
    assert _std(moe, "layers.2.mlp.moe.experts.w2") == pytest.approx(0.02 / 2, rel=0.1)  # depth 2: 0.02/sqrt(4)


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny", "qwen2-moe-tiny"])
def test_a_stage_builds_its_layers_as_the_whole_model_does(preset):
    """Each layer draws from its own generator: a pipeline stage holding layers 2-3 gets the same numbers."""
    config = ModelConfig(**PRESETS[preset])
    whole = dict(build_model(config, seed=5).named_parameters())
    part = build_model(config, seed=5, layers={2, 3})
    for name, p in part.named_parameters():
        if name.startswith(("layers.2.", "layers.3.")):
            assert torch.equal(p, whole[name]), name
