"""A pipeline stage: its layers in order, each handed the step's side inputs it takes.

The activation is the one tensor that travels between stages. What else a layer needs per microbatch
(a packed batch's documents, context parallelism's positions, multi-token prediction's targets) every
rank already holds, so it does not travel: the executor passes it to the stage's forward as keyword
arguments (its ``side_inputs``), and the stage gives each layer the ones its ``forward`` names.
Arguments no layer of this stage takes are ignored (a stage without the output head ignores the
prediction targets). pp knows nothing of what they mean.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn


@functools.cache
def _named_inputs(forward: Callable[..., Any]) -> frozenset[str]:
    return frozenset(list(inspect.signature(forward).parameters)[2:])  # past self and the activation


def accepted_inputs(layer: nn.Module) -> frozenset[str]:
    """The arguments after the activation that ``layer``'s class's ``forward`` names."""
    return _named_inputs(type(layer).forward)


class Stage(nn.Sequential):
    """``nn.Sequential`` whose forward also takes side inputs and gives each layer those it names."""

    def forward(self, input: Any, **side_inputs: Any) -> Any:  # noqa: A002  # nn.Sequential names it input
        x = input
        for layer in self:
            names = accepted_inputs(layer)
            x = layer(x, **{k: v for k, v in side_inputs.items() if k in names})
        return x
