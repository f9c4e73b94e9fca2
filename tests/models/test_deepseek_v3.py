"""DeepSeek-V3's pieces on one process: the presets' parameter counts equal transformers' (both built on the
meta device), MLA under document masks equals MLA run on each document alone, YaRN's frequencies and
factor equal transformers', and bad settings are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from polyshard.models import parameter_count
from polyshard.models.common import MLA, Documents, RopeConfig, document_positions, rope_frequencies
from polyshard.trainer.config import from_dict
from tests._bounds import reordered_sum

transformers = pytest.importorskip("transformers")


def _hf_config(name):
    t = transformers
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip
    if name == "deepseek-v3":  # DeepSeek-V3's config.json (its defaults in transformers, plus its YaRN)
        yarn = {**yarn, "mscale": 1.0, "mscale_all_dim": 1.0}
        return t.DeepseekV3Config(max_position_embeddings=163840, rope_parameters=yarn)
    return t.DeepseekV2Config(  # DeepSeek-V2-Lite's config.json
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, num_experts_per_tok=6,
        first_k_dense_replace=1, topk_method="greedy", max_position_embeddings=163840,
        rope_parameters={**yarn, "mscale": 0.707, "mscale_all_dim": 0.707},
    )  # fmt: skip


@pytest.mark.parametrize("name, billions", [("deepseek-v3", 671), ("deepseek-v2-lite", 15.7)])
def test_the_presets_count_transformers_parameters(name, billions):
    config = from_dict({"model": {"preset": name}}).model
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(_hf_config(name))
    theirs = sum(p.numel() for p in hf.parameters())
    assert parameter_count(config) == theirs
    assert theirs / 1e9 == pytest.approx(billions, rel=0.01)


def test_yarn_is_transformers_yarn():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_config("deepseek-v3")
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    yarn = RopeConfig(factor=40.0, scaling="yarn", original_context=4096, mscale=1.0, mscale_all_dim=1.0)
    assert torch.equal(rope_frequencies(64, yarn), inv)
    assert yarn.attention_scale == factor


def _mla():
    torch.manual_seed(0)
    mla = MLA(32, 4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
              rope=RopeConfig(), core="blocksparse")  # fmt: skip
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return mla


def test_document_masks_keep_mla_inside_each_document():
    """Two documents packed in one row: each token's output is that of its document run alone (attention
    inside it, rotary positions restarting at its start). Tolerance 1e-6: float32 sums over fewer keys."""
    mla, x = _mla(), torch.randn(1, 10, 32)
    segments = torch.tensor([[0] * 4 + [1] * 6])
    packed = mla(x, Documents(segments=segments, positions=document_positions(segments)))
    alone = torch.cat([mla(x[:, :4]), mla(x[:, 4:])], dim=1)
    # float32: the packed row's softmax adds zeros for the other document's keys (exact), its matmuls run
    # on 10 rows instead of 4 and 6 (another blocking of fan-ins 32, 24, 16, 8): reordered_sum(80) ~ 9e-6
    # relative worst case, 1e-6 in practice for O(1) outputs; a key leaking across documents moves ~1e-1.
    torch.testing.assert_close(packed, alone, rtol=1e-6, atol=reordered_sum(80))


@pytest.mark.parametrize(
    "model, message",
    [
        ({"qk_rope_head_dim": 7, "qk_nope_head_dim": 15}, "model.qk_rope_head_dim=7 must be even"),
        ({"num_kv_heads": 2}, "model.num_kv_heads is not a setting of model.kind='deepseek-v3'"),
        ({"moe": {"dense_layers": [9]}}, r"model.moe.dense_layers=\[9\] names blocks \[9\] past the last block"),
        ({"kv_lora_rank": 0}, "model.kv_lora_rank=0"),
        ({"rope": {"factor": 0.5}}, "model.rope.factor=0.5 must be a finite number >= 1"),
        ({"norm": "layer"}, "model.norm='layer': DeepSeek's blocks use 'rms'"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(model, message):
    from polyshard.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        from_dict({"model": {"kind": "deepseek-v3", **model}})


def test_tp_must_divide_the_heads():
    from polyshard.trainer.engine.constraints import validate
    from polyshard.trainer.errors import ConfigError

    config = from_dict({"model": {"kind": "deepseek-v3", "num_heads": 2, "hidden": 32}, "parallel": {"tp": 4}})
    with pytest.raises(ConfigError, match="parallel.tp=4 does not divide model.num_heads=2"):
        validate(config, world_size=4)
