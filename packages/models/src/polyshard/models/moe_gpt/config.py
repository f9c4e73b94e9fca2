"""The MoE GPT's settings (``[model] kind = "moe-gpt"``): a decoder with grouped-query attention and
experts (``[model.moe]``): Mixtral's, Qwen-MoE's and DeepSeek-style routing on Llama-like blocks."""

from __future__ import annotations

from dataclasses import dataclass

from polyshard.models.decoder import Experts, GroupedAttention


@dataclass(kw_only=True, frozen=True)
class MoEGPTConfig(Experts, GroupedAttention):
    kind: str = "moe-gpt"
