"""The initialisation rule of the families' models: GPT-2's, by parameter name."""

from __future__ import annotations

import torch
from torch import nn


def init_weights(module: nn.Module, num_layers: int, generator: torch.Generator | None = None) -> None:
    """GPT-2 initialisation (Llama's too): N(0, 0.02), output projections scaled by 1/sqrt(2 x layers)."""
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif "norm" in name:
            nn.init.ones_(p)
        elif name.endswith(("o_proj.weight", "fc_out.weight", "down_proj.weight", "experts.w2")):
            nn.init.normal_(p, std=0.02 / (2 * num_layers) ** 0.5, generator=generator)
        else:
            nn.init.normal_(p, std=0.02, generator=generator)
    # The layer was built on the meta device and moved with to_empty: its buffers hold garbage until set.
    # The families' buffers (a sigmoid router's selection bias) start at zero.
    for _, b in module.named_buffers():
        if b.is_floating_point():
            b.zero_()
