"""The initialisation rules of the families' models, by parameter name, one pipeline layer at a time.

* ``gpt2`` (:func:`init_weights`): GPT-2's N(0, 0.02), output projections scaled by 1/sqrt(2 x layers).
* ``depth`` (:func:`init_depth_scaled`): the rule torchtitan and Megatron-LM train Llama with. The
  embedding is N(0, 1) — a pre-norm model normalises it before use, and a 0.02 embedding would make the
  first norm multiply its gradient by ~50 (the first gradient norms of 19 against torchtitan's 1.3 that
  issue 34 measured); block matrices N(0, 0.02), those that write into the residual stream (attention
  output, MLP up and down, the experts' and router's likewise) 0.02 / sqrt(2 x d) for the block at depth
  d = 1..layers (torchtitan's ``depth_init``: early blocks move the stream more than late ones); the head
  hidden^-0.5, so the first logits are O(1) whatever the width. Every draw is a normal truncated at
  3 standard deviations (torchtitan truncates the head there; its other bounds are +-2 absolute,
  100 standard deviations of 0.02, so a plain normal in effect: we cut every tail alike).

A layer knows its place through :class:`LayerPlace`; each draws from its own generator, so a pipeline
stage that builds only its layers gets the numbers a full build gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

CUTOFF = 3.0  # truncated normals end at +-3 standard deviations
# Matrices that write into the residual stream (GPT-2's rule scales the output projections only).
GPT2_OUTPUTS = ("o_proj.weight", "fc_out.weight", "down_proj.weight", "experts.w2")
DEPTH_SCALED = (*GPT2_OUTPUTS, "up_proj.weight", "experts.w3", "router.weight")


@dataclass(frozen=True)
class LayerPlace:
    """Where a pipeline layer sits in a language model: ``index`` 0 is the embedding, 1..``num_layers``
    the blocks (their depth), ``num_layers + 1`` the head. ``tied``: the head's weight is the embedding's."""

    index: int
    num_layers: int
    hidden: int
    tied: bool = False


def init_weights(module: nn.Module, num_layers: int, generator: torch.Generator | None = None) -> None:
    """GPT-2 initialisation: N(0, 0.02), output projections scaled by 1/sqrt(2 x layers)."""
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif "norm" in name:
            nn.init.ones_(p)
        elif name.endswith(GPT2_OUTPUTS):
            nn.init.normal_(p, std=0.02 / (2 * num_layers) ** 0.5, generator=generator)
        else:
            nn.init.normal_(p, std=0.02, generator=generator)
    _zero_buffers(module)


def init_depth_scaled(module: nn.Module, place: LayerPlace, generator: torch.Generator | None = None) -> None:
    """The ``depth`` rule (module docstring) for the layer at ``place``."""
    head_std = place.hidden**-0.5
    is_head = place.index == place.num_layers + 1
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif "norm" in name:
            nn.init.ones_(p)
        elif place.index == 0 and name == "tok.weight":
            # Tied, the embedding is the head too: the head's scale keeps the first logits O(1).
            _truncated(p, head_std if place.tied else 1.0, generator)
        elif is_head and name == "proj.weight":
            _truncated(p, head_std, generator)
        elif 1 <= place.index <= place.num_layers and name.endswith(DEPTH_SCALED):
            _truncated(p, 0.02 / math.sqrt(2 * place.index), generator)
        else:
            _truncated(p, 0.02, generator)
    _zero_buffers(module)


def _truncated(p: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    nn.init.trunc_normal_(p, std=std, a=-CUTOFF * std, b=CUTOFF * std, generator=generator)


def _zero_buffers(module: nn.Module) -> None:
    # The layer was built on the meta device and moved with to_empty: its buffers hold garbage until set.
    # The families' buffers (a sigmoid router's selection bias) start at zero.
    for _, b in module.named_buffers():
        if b.is_floating_point():
            b.zero_()
