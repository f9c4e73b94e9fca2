"""Models as plain PyTorch; each exposes ``model.layers``, its ordered pipeline layers.

Layer ``i`` draws its initial weights from its own generator, seeded from
``(seed, i)``. A pipeline stage can therefore build just its own layers (the
rest stay on the meta device: shapes, no memory) and get the same numbers as a
full build on one process.
"""

from collections.abc import Collection
from typing import cast

import torch
from torch import nn

from polyshard.models.common.initialise import LayerPlace, init_depth_scaled
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.registry import SPECS
from polyshard.models.spec import BuildOptions, ModelSpec, layer_of


def spec_of(config: ModelConfig) -> ModelSpec:
    """The spec of ``config``'s family; an unknown ``model.kind`` is a :class:`ConfigError` naming the kinds."""
    spec = SPECS.get(config.kind)
    if spec is None:
        raise ConfigError(f"model.kind={config.kind!r}; choose one of {list(SPECS)}")
    return spec


def check_model(config: ModelConfig) -> None:
    """The family's constraints between ``[model]`` fields (a :class:`ConfigError` naming them)."""
    spec_of(config).check_model(config)


def output_width(config: ModelConfig) -> int:
    """Outputs per position: the vocabulary of a language model, the classes of a classifier."""
    return spec_of(config).output_width(config)


def sequence_length(config: ModelConfig) -> int:
    """Positions per example the transformer sees (patches + class token for the ViT)."""
    return spec_of(config).sequence_length(config)


def build_model(
    config: ModelConfig,
    *,
    seed: int = 0,
    layers: Collection[int] | None = None,
    device: torch.device | str = "cpu",
    checkpoint_activations: bool | str = False,
    aux_loss_scale: float = 1.0,
    head_logits: bool = True,
    mtp_loss_weight: float = 0.3,
) -> nn.Module:
    """The unparallelised model ``config`` describes, with every layer (or only ``layers``) on ``device``.

    ``checkpoint_activations``: blocks recompute their insides in backward ("full" or "selective").
    ``aux_loss_scale``: the gradient of an MoE layer's aux loss (1 / microbatches when a step accumulates
    several). ``head_logits``: False has a language model's head return its normed hidden states, for a
    loss that projects them itself (``training.loss_chunks``). ``mtp_loss_weight``: lambda of a model with
    multi-token prediction (``model.mtp_depth`` > 0).
    """
    spec = spec_of(config)
    spec.check_model(config)  # a model is built only from settings its family accepts
    with torch.device("meta"):
        model = spec.build(config, BuildOptions(checkpoint_activations, aux_loss_scale, head_logits, mtp_loss_weight))
    ties = spec.tied(config)
    # A family's model keeps its pipeline layers in an nn.ModuleList (models.spec); torch types it Tensor | Module.
    wanted = set(range(len(cast(nn.ModuleList, model.layers))) if layers is None else layers)
    for alias, name in ties.items():  # an alias is drawn from its weight's layer's generator
        if layer_of(alias) in wanted:
            wanted.add(layer_of(name))
    for i in sorted(wanted):
        layer = cast(nn.ModuleList, model.layers)[i].to_empty(device=device)
        generator = layer_generator(seed, i, device)
        with torch.no_grad():
            if config.init_rule == "depth":
                # the head's weight is the embedding's (a tie of the prediction depths' embedding is not that)
                head_tied = any(alias.endswith(".proj.weight") for alias in ties)
                place = LayerPlace(i, config.num_layers, config.hidden, tied=head_tied)
                init_depth_scaled(layer, place, generator)
            else:
                spec.init(layer, config.num_layers, generator)
    for alias, name in ties.items():  # to_empty gave each its own tensor: tie them again
        module, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(module), attr, model.get_parameter(name))
    return model


def parameter_count(config: ModelConfig) -> int:
    """The model's parameters, counted on the meta device (nothing is allocated); a tied weight once."""
    model = build_model(config, layers=())
    return sum(p.numel() for p in model.parameters())


ROUTED_EXPERTS = ".experts."
"""The name part of an MoE layer's routed experts' stacked weights (E, ...): ``layers.<i>.mlp.moe.experts.w1``."""


def active_share(config: ModelConfig, name: str) -> float:
    """The share of parameter ``name`` one token computes with: top_k / num_experts for the routed experts'
    stacked weights (each token runs top_k of the E experts), 1 for every other parameter."""
    if ROUTED_EXPERTS not in name or not spec_of(config).has_experts:
        return 1.0
    moe = getattr(config, "moe")  # noqa: B009  (a family with experts has [model.moe])
    return float(moe.top_k / moe.num_experts)


def active_parameter_count(config: ModelConfig) -> int:
    """The parameters one token computes with (what an MoE's FLOPs scale with): the routed experts count
    top_k / num_experts of theirs; a dense layer's MLP, the shared experts and the rest count whole.
    Equals :func:`parameter_count` for a model without experts."""
    model = build_model(config, layers=())
    return round(sum(p.numel() * active_share(config, name) for name, p in model.named_parameters()))


def tied_names(config: ModelConfig) -> dict[str, str]:
    """Parameter names that are another parameter of the same model (tied weights): alias -> name.

    With ``tie_embeddings`` the output head's weight is the token embedding
    (GPT-2, Llama-3.2): ``{"layers.<last>.proj.weight": "layers.0.tok.weight"}``.
    One process holds one tensor under the name; a pipeline whose first and last
    stages differ holds a copy on each, kept equal by summing their gradients.
    """
    return spec_of(config).tied(config)


def layer_generator(seed: int, layer: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator layer ``layer``'s initial weights come from."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + layer)
