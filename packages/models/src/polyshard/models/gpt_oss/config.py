"""gpt-oss's settings (``[model] kind = "gpt-oss"``): the MoE GPT's fields with gpt-oss's architecture as
the defaults, so a config states only the sizes (or a preset)."""

from __future__ import annotations

from dataclasses import dataclass, field

from polyshard.models.common.moe import MoEConfig
from polyshard.models.moe_gpt.config import MoEGPTConfig


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


@dataclass(kw_only=True, frozen=True)
class GptOssConfig(MoEGPTConfig):
    kind: str = "gpt-oss"
    norm: str = "rms"
    activation: str = "swiglu"
    positions: str = "rope"
    bias: bool = True
    """Biases on q, k, v and o (gpt-oss's attention_bias)."""
    attention_sinks: bool = True
    rope_theta: float = 150000.0
    rope_type: str = "yarn"
    rope_truncate: bool = False
    rope_original_context: int = 4096
    moe: MoEConfig = field(default_factory=gpt_oss_experts)
    """Every block's MLP is a mixture of experts with these settings (``[model.moe]``; gpt-oss's defaults)."""
