"""Where a built model keeps the parts the strategies and the trainer act on, found by asking here.

The trainer, the planner and the checkpoint code never test a module's class themselves (a test reads
their sources for ``isinstance`` against this package's classes): context parallelism swaps the cores of
:func:`attention_layers`, expert parallelism shards :func:`moe_layers`, ``training.compile`` and
generation act on :func:`transformer_blocks`, and multi-token prediction's losses come from
:func:`multi_token_predictions`. A family whose modules are its own classes answers here, in one place
(Megatron-LM's layer specs are the same idea: the rest asks the spec, not the type).
"""

from __future__ import annotations

from torch import nn

from polyshard.models.common.attention import Attention, CoreAttention
from polyshard.models.common.block import Block
from polyshard.models.common.mla import MLA
from polyshard.models.common.moe import MoELayer
from polyshard.models.common.mtp import MultiTokenPrediction

ATTENTION_LAYERS = (Attention, MLA)
"""The attention modules whose inner product (``.core``) context parallelism may replace: MLA's q/k and v
differ in head dims, which the cores allow."""


def attention_layers(model: nn.Module) -> list[tuple[nn.Module, CoreAttention]]:
    """Every attention layer in ``model`` with the core the model built for it, in module order. Raises
    ``TypeError`` for a core that is already replaced (a strategy swaps each one once)."""
    found: list[tuple[nn.Module, CoreAttention]] = []
    for module in model.modules():
        if isinstance(module, ATTENTION_LAYERS):
            core = module.core
            if not isinstance(core, CoreAttention):
                raise TypeError(f"{type(module).__name__}.core is already a {type(core).__name__}, not the model's own")
            found.append((module, core))
    return found


def attention_cores(model: nn.Module) -> list[CoreAttention]:
    """The cores of ``model``'s attention layers as the model built them (causal or not, their windows)."""
    return [core for _, core in attention_layers(model)]


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """Every mixture-of-experts layer in ``model`` (the modules expert parallelism shards), by its name
    in ``model``."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoELayer)]


def has_moe(model: nn.Module) -> bool:
    """Whether ``model`` holds any mixture-of-experts layer."""
    return any(isinstance(module, MoELayer) for module in model.modules())


def transformer_blocks(model: nn.Module) -> list[Block]:
    """Every transformer block in ``model`` (a prediction depth's too), the unit ``training.compile``
    compiles and generation runs eagerly."""
    return [module for module in model.modules() if isinstance(module, Block)]


def multi_token_predictions(model: nn.Module) -> list[MultiTokenPrediction]:
    """The multi-token prediction modules in ``model`` (at most one, in the output head's layer)."""
    return [module for module in model.modules() if isinstance(module, MultiTokenPrediction)]
