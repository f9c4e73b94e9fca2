"""gpt-oss's parts one at a time against transformers' modules: YaRN's frequencies and attention scale (gpt-oss's
untruncated ramp, and DeepSeek-V3's truncated one with mscale / mscale_all_dim), the router (a biased linear,
softmax over the chosen top-k logits) and the biased clamped-SwiGLU experts, on one process; and the checks
of the new MoE options.

Tolerances: frequencies are computed in the same float32 operations as transformers': equal. The router and
experts run the same float32 maths in another order (grouped matmuls over the experts' rows vs one matmul
per expert): float32 round-off on O(1) values, 1e-6."""

import pytest
import torch

from polyshard.models.common import RopeConfig, rope_frequencies
from polyshard.models.common.moe import MoEConfig, MoEConfigError, MoELayer

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss as hf  # noqa: E402


def _hf_yarn(head_dim, theta, **params):
    config = transformers.GptOssConfig(
        head_dim=head_dim, rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params}
    )
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


YARN = {
    "gpt-oss": (64, 150000.0, {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 4096}),
    "deepseek-v3": (64, 10000.0, {"factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
    "deepseek-mscale": (64, 10000.0, {"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                                      "original_max_position_embeddings": 4096}),
    "attention-factor": (16, 10000.0, {"factor": 4.0, "attention_factor": 1.5, "original_max_position_embeddings": 16}),
}  # fmt: skip


@pytest.mark.parametrize("name", YARN)
def test_yarn_is_transformers(name):
    head_dim, theta, params = YARN[name]
    inv, scale = _hf_yarn(head_dim, theta, **params)
    ours = RopeConfig(
        theta=theta,
        factor=params["factor"],
        original_context=params["original_max_position_embeddings"],
        scaling="yarn",
        beta_fast=params.get("beta_fast", 32.0),
        beta_slow=params.get("beta_slow", 1.0),
        truncate=params.get("truncate", True),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
    )
    assert torch.equal(rope_frequencies(head_dim, ours), inv)
    assert ours.attention_scale == pytest.approx(scale, rel=1e-15)


def test_yarn_settings_are_checked():
    with pytest.raises(ValueError, match=r"model.rope.scaling='ntk'; choose one of \['none', 'llama3', 'yarn'\]"):
        RopeConfig(factor=2.0, scaling="ntk")
    with pytest.raises(ValueError, match="model.rope.beta_slow=0.0"):
        RopeConfig(factor=2.0, scaling="yarn", beta_slow=0.0)
    with pytest.raises(ValueError, match="model.rope.mscale=-1"):
        RopeConfig(factor=2.0, scaling="yarn", mscale=-1)
    with pytest.raises(ValueError, match="model.rope.factor=2.0 stretches the context by a rule"):
        RopeConfig(factor=2.0)


def test_router_and_experts_are_transformers():
    torch.manual_seed(0)
    config = transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    theirs = hf.GptOssMLP(config)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 1.0)  # large values: the clamps at +-7 bite, the router is decisive
    layer = MoELayer(
        MoEConfig(ffn_hidden=8, num_experts=4, top_k=2, score="topk-softmax", router_bias=True,
                  expert_bias=True, activation="clamped-swiglu", renormalize=False), hidden=16
    )  # fmt: skip
    with torch.no_grad():
        layer.router.weight.copy_(theirs.router.weight)
        layer.router.logit_bias.copy_(theirs.router.bias)
        layer.experts.w1.copy_(theirs.experts.gate_up_proj)
        layer.experts.w1_bias.copy_(theirs.experts.gate_up_proj_bias)
        layer.experts.w2.copy_(theirs.experts.down_proj)
        layer.experts.w2_bias.copy_(theirs.experts.down_proj_bias)
    x = torch.randn(2, 5, 16)
    expected, _ = theirs(x)
    ours, _ = layer(x)
    with torch.no_grad():  # gate/up values past the limit of 7: the clamps are exercised
        assert ((x @ theirs.experts.gate_up_proj[0] + theirs.experts.gate_up_proj_bias[0]).abs() > 7).any()
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"activation": "relu"}, "activation='relu' is unknown"),
        ({"activation": "clamped-swiglu", "swiglu_limit": 0.0}, "swiglu_limit=0.0 must be a finite number > 0"),
        ({"swiglu_alpha": float("nan")}, "swiglu_alpha=nan must be a finite number > 0"),
        ({"score": "topk-softmax", "groups": 2, "group_topk": 1}, "groups=2 limits routing"),
    ],
)
def test_new_options_are_checked(settings, message):
    with pytest.raises(MoEConfigError, match=message):
        MoEConfig(ffn_hidden=8, num_experts=4, top_k=2, **settings)
