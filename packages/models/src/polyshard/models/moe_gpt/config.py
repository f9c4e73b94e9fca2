"""The MoE GPT's settings (``[model] kind = "moe-gpt"``): the GPT's, and its experts in ``[model.moe]``."""

from __future__ import annotations

from dataclasses import dataclass, field

from polyshard.ep import MoEConfig
from polyshard.models.common.moe import MoESettings
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.gpt.config import GPTConfig


@dataclass(kw_only=True, frozen=True)
class MoEGPTConfig(GPTConfig):
    kind: str = "moe-gpt"
    moe: MoESettings = field(default_factory=MoESettings)
    """Every block's MLP is a mixture of experts with these settings (``[model.moe]``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer()  # the routing rules against this model's widths

    def layer(self) -> MoEConfig:
        """Each block's MoE layer."""
        return self.moe.layer(hidden=self.hidden, ffn_hidden=self.expert_width)

    @property
    def expert_width(self) -> int:
        """Width of each routed expert: moe.ffn_hidden, or the MLP width / top_k when unset."""
        return self.moe.expert_width(self.mlp_width)

    @property
    def shared_width(self) -> int:
        """Width of the shared experts' one MLP; 0 without them."""
        return self.moe.shared_width(self.mlp_width)


def moe_config(model: ModelConfig) -> MoEGPTConfig:
    """``model`` as the MoE GPT's settings (the spec's functions are declared over every family's)."""
    if not isinstance(model, MoEGPTConfig):
        raise ConfigError(f"model.kind={model.kind!r} has no experts; this needs model.kind='moe-gpt'")
    return model
