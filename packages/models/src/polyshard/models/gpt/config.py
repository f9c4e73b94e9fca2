"""The GPT family's settings (``[model] kind = "gpt"``): a decoder with grouped-query attention, GPT-2's and
Llama's architectures (Qwen2's, Qwen3's and Mistral's too) by their defaults and presets."""

from __future__ import annotations

from dataclasses import dataclass

from polyshard.models.decoder import GroupedAttention


@dataclass(kw_only=True, frozen=True)
class GPTConfig(GroupedAttention):
    kind: str = "gpt"
