"""gpt-oss's settings (``[model] kind = "gpt-oss"``): the parts the MoE GPT has (grouped attention,
experts), with gpt-oss's architecture as their defaults, so a config states only the sizes (or a preset)."""

from __future__ import annotations

from dataclasses import dataclass, field

from polyshard.models.common.moe import MoEConfig
from polyshard.models.common.rotary import RopeConfig
from polyshard.models.decoder import Experts, GroupedAttention


def gpt_oss_experts() -> MoEConfig:
    """gpt-oss's ``[model.moe]`` defaults: a biased router whose top-k logits are softmaxed, biased experts
    with the clamped SwiGLU (alpha 1.702, limit 7), and transformers' router_aux_loss_coef (0.001)."""
    return MoEConfig(
        num_experts=32,
        top_k=4,
        score="topk-softmax",
        renormalize=False,  # the softmax over the k chosen logits already sums to 1
        router_bias=True,
        activation="clamped-swiglu",
        expert_bias=True,
        aux_loss_coef=0.001,
    )


def gpt_oss_rope() -> RopeConfig:
    """gpt-oss's ``[model.rope]`` defaults: theta 150000 and YaRN without truncation over 4096 positions
    (the factor, 32 in the releases, comes with the sizes)."""
    return RopeConfig(theta=150000.0, scaling="yarn", truncate=False, original_context=4096)


@dataclass(kw_only=True, frozen=True)
class GptOssConfig(Experts, GroupedAttention):
    kind: str = "gpt-oss"
    norm: str = "rms"
    activation: str = "swiglu"
    positions: str = "rope"
    bias: bool = True
    """Biases on q, k, v and o (gpt-oss's attention_bias)."""
    attention_sinks: bool = True
    rope: RopeConfig = field(default_factory=gpt_oss_rope)
    moe: MoEConfig = field(default_factory=gpt_oss_experts)
    """Every block's MLP is a mixture of experts with these settings (``[model.moe]``; gpt-oss's defaults)."""
