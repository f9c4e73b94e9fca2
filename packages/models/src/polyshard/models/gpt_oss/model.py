"""gpt-oss as polyshard modules: the MoE GPT's (:mod:`polyshard.models.moe_gpt.model`) with sinks in every
attention softmax, alternating sliding-window and full blocks, YaRN rotary positions, q/k/v/o biases, and
MoE layers whose router (a biased linear, softmax over the chosen top-k logits) and experts (biased, the
clamped SwiGLU) are :mod:`polyshard.models.common.moe`'s general options. It splits as the MoE GPT does
(:mod:`polyshard.models.moe_gpt.plan`): heads (and their sinks) over tp, experts (and their biases) over ep."""

from __future__ import annotations

from polyshard.models.decoder import decoder_shape
from polyshard.models.gpt import model as gpt
from polyshard.models.gpt_oss.config import GptOssConfig
from polyshard.models.gpt_oss.hf import GPT_OSS
from polyshard.models.gpt_oss.presets import PRESETS
from polyshard.models.moe_gpt import model as moe_gpt
from polyshard.models.moe_gpt.plan import check, tp_plan
from polyshard.models.spec import ModelSpec

SPEC = ModelSpec(
    shape=decoder_shape,
    kind="gpt-oss",
    config=GptOssConfig,
    presets=PRESETS,
    sequence_length=gpt.sequence_length,
    output_width=gpt.vocab_size,
    task="language",
    build=moe_gpt.build,
    tp_plan=tp_plan,
    has_experts=True,
    tied=gpt.tied,
    check=check,
    context_parallel=True,  # cp's ring skips key/value blocks outside a sliding window; sinks per query head
    hf_adapters=(GPT_OSS,),
)
