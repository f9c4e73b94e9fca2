"""The MoE GPT's settings (``[model] kind = "moe-gpt"``): the GPT's, and its experts in ``[model.moe]``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from polyshard.models.common.moe import MoEConfig
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.gpt.config import GPTConfig, gpt_shape
from polyshard.models.shape import ExpertShape, ModelShape


@dataclass(kw_only=True, frozen=True)
class MoEGPTConfig(GPTConfig):
    kind: str = "moe-gpt"
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Every block's MLP (but ``moe.dense_layers``') is a mixture of experts with these settings (``[model.moe]``)."""
    all_dense_allowed: ClassVar[bool] = False
    """Whether every block may be dense (DeepSeek's MLA is a model of its own without experts)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        dense = self.moe.dense_layers
        outside = [i for i in dense if i >= self.num_layers]
        if outside:
            raise ConfigError(
                f"model.moe.dense_layers={dense!r} names blocks {outside} past the last block "
                f"({self.num_layers - 1}; blocks count from 0); keep indices below model.num_layers={self.num_layers}"
            )
        if len(set(dense)) == self.num_layers and not self.all_dense_allowed:
            raise ConfigError(
                f"model.moe.dense_layers={dense!r} leaves no block with experts; use model.kind='gpt' for a dense "
                "model, or leave at least one block out of dense_layers"
            )

    def sparse_layer(self, i: int) -> bool:
        """Whether block ``i`` (0-based; pipeline layer ``i + 1``) holds experts rather than a dense MLP."""
        return i not in self.moe.dense_layers

    @property
    def sparse_layers(self) -> list[int]:
        """The blocks (0-based) that hold experts."""
        return [i for i in range(self.num_layers) if self.sparse_layer(i)]

    @property
    def dense_width(self) -> int:
        """Width of the dense blocks' MLP: moe.dense_ffn_hidden, or the model's MLP width when unset."""
        return self.moe.dense_ffn_hidden or self.mlp_width

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


def moe_shape(model: ModelConfig) -> ModelShape:
    """The GPT's shape with experts in every block but ``moe.dense_layers``, which keep a dense MLP of
    their own width."""
    moe = moe_config(model)
    experts = ExpertShape(moe.moe.num_experts, moe.moe.top_k, moe.expert_width, moe.shared_width)
    dense = frozenset(moe.moe.dense_layers)
    return dataclasses.replace(gpt_shape(moe), mlp_width=moe.dense_width, experts=experts, dense_blocks=dense)
