"""Training FLOPs per token: one count, which MFU (``model_flops_per_token`` in the metrics) and the
planner's step time both use.

Per pipeline layer, per token, in the forward pass (a multiply-add is 2 FLOPs)::

    matmul     2 x the matmul weights the token passes through: a routed expert's by top_k / E (a token
               runs top_k of the E experts), a weight used twice (a tied head) where it multiplies;
               embedding tables and tables added to every example (a ViT's class token and positions)
               are lookups and additions, not matmuls
    attention  per attention layer 2 x keys x n (Dqk + Dv): q·k over Dqk and the weighted sum over Dv,
               for the mean number of keys a query sees: s / 2 causal (half the scores), about
               w - w^2 / 2s under a sliding window w < s, s without a mask

The backward pass computes the input and the weight gradients, twice the forward's work, so training
is 3 x the forward: 6N + 6 s n (Dqk + Dv) / 2 per block. That is PaLM's 6N + 12·L·h·s (appendix B) with
N the matmul weights alone and causal attention's masked half left out (for a GPT, n (Dqk + Dv) = 2h);
multi-head latent attention's heads are wider than the hidden size (DeepSeek-V3: 128 x 320 against
7,168), which 12·L·h·s misses. Multi-token prediction's blocks count in the head's layer; reusing the
output head for each depth's logits is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from polyshard.models.anatomy import attention_layers
from polyshard.models.build import active_share, build_model, sequence_length, spec_of
from polyshard.models.config import ModelConfig
from polyshard.models.spec import layer_of


@dataclass(frozen=True)
class LayerFlops:
    """One pipeline layer's forward FLOPs per token."""

    matmul: float
    """2 x its matmul weights a token passes through."""
    attention: float
    """Its attention layers' scores and weighted sums."""

    @property
    def forward(self) -> float:
        return self.matmul + self.attention


def mean_keys(length: int, causal: bool, window: int | None) -> float:
    """Keys a query of a ``length``-token sequence sees, on average (see the module docstring)."""
    if not causal:
        return float(length)
    if window is None or window >= length:
        return length / 2
    return window - window * window / (2 * length)


def _is_matmul_weight(module: nn.Module, param: nn.Parameter) -> bool:
    """A weight some input is multiplied by: a linear's (a one-output gate's too) or another module's
    matrix (a router's, stacked experts'), but not an embedding's table nor a table added to every
    example (a leading dim of 1: a ViT's class token and positions)."""
    if isinstance(module, nn.Linear):
        return param.dim() >= 2
    return param.dim() >= 2 and not isinstance(module, nn.Embedding) and param.shape[0] != 1


def layer_flops(config: ModelConfig) -> tuple[LayerFlops, ...]:
    """Per pipeline layer, the forward FLOPs per token, from a build on the meta device (cached by the
    config's repr: a list field leaves the config itself unhashable)."""
    key = repr(config)
    if key not in _CACHE:
        if len(_CACHE) >= 32:
            _CACHE.clear()
        _CACHE[key] = _count(config)
    return _CACHE[key]


_CACHE: dict[str, tuple[LayerFlops, ...]] = {}


def _count(config: ModelConfig) -> tuple[LayerFlops, ...]:
    model = build_model(config, layers=())
    layers = list(model.get_submodule("layers").children())
    matmul = [0.0] * len(layers)
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):  # a tied weight under each of its users
            full = f"{module_name}.{name}"
            if full.startswith("layers.") and _is_matmul_weight(module, param):
                matmul[layer_of(full)] += 2 * param.numel() * active_share(config, full)
    width = spec_of(config).shape(config).attention.score_width
    length = sequence_length(config)
    attention = [
        sum(2 * mean_keys(length, core.causal, core.window) * width for _, core in attention_layers(layer))
        for layer in layers
    ]
    return tuple(LayerFlops(m, a) for m, a in zip(matmul, attention))


def flops_per_token(config: ModelConfig) -> float:
    """Training FLOPs per token (forward and backward): 3 x the forward's, summed over the layers."""
    return 3 * sum(layer.forward for layer in layer_flops(config))
