"""A tiny MLP described as layer builders, and its single-process reference, shared by the pp tests.

Each layer is seeded by its global index, so a rank that builds only its own
stage gets exactly the weights of the same layers in the reference model.
"""

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN = 16
NUM_LAYERS = 8


class Layer(nn.Sequential):
    def __init__(self, index: int, hidden: int = HIDDEN):
        torch.manual_seed(1000 + index)
        super().__init__(nn.Linear(hidden, hidden), nn.Tanh())


def builders(num_layers: int = NUM_LAYERS, hidden: int = HIDDEN):
    return [lambda i=i: Layer(i, hidden) for i in range(num_layers)]


def reference(num_layers: int = NUM_LAYERS, hidden: int = HIDDEN) -> nn.Sequential:
    return nn.Sequential(*[build() for build in builders(num_layers, hidden)])


def batch(step: int, size: int, hidden: int = HIDDEN):
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, hidden, generator=g), torch.randn(size, hidden, generator=g)


def loss_fn(output, target):
    return F.mse_loss(output, target)  # mean over the microbatch: the executor divides by m


def reference_param(ref: nn.Sequential, placement_name: str) -> torch.Tensor:
    """The reference parameter behind a stage parameter's placement name ``layers.{i}.{name}``."""
    return ref.get_parameter(placement_name.removeprefix("layers."))
