"""Models as plain PyTorch; each exposes ``model.layers``, its ordered pipeline layers.

Layer ``i`` draws its initial weights from its own generator, seeded from
``(seed, i)``. A pipeline stage can therefore build just its own layers (the
rest stay on the meta device: shapes, no memory) and get the same numbers as a
full build on one process.
"""

from collections.abc import Collection

import torch
from torch import nn

from polyshard.ep import MoEConfig
from polyshard.tp.transformer import RopeScaling
from polyshard.trainer.config import ModelConfig
from polyshard.trainer.models.gpt import GPT
from polyshard.trainer.models.init import init_weights
from polyshard.trainer.models.moe import MoEMLP
from polyshard.trainer.models.vit import ViT


def build_model(
    config: ModelConfig,
    *,
    seed: int = 0,
    layers: Collection[int] | None = None,
    device: torch.device | str = "cpu",
    checkpoint_activations: bool = False,
    aux_loss_scale: float = 1.0,
) -> nn.Module:
    """The unparallelised model ``config`` describes, with every layer (or only ``layers``) on ``device``.

    ``checkpoint_activations``: blocks recompute their insides in backward. ``aux_loss_scale``: the
    gradient of an MoE layer's aux loss (1 / microbatches when a step accumulates several).
    """
    with torch.device("meta"):
        model = _construct(config, checkpoint_activations, aux_loss_scale)
    wanted = set(range(len(model.layers)) if layers is None else layers)
    if tied_names(config) and len(model.layers) - 1 in wanted:
        wanted.add(0)  # the head's weight is the embedding's, drawn from layer 0's generator
    for i in sorted(wanted):
        layer = model.layers[i].to_empty(device=device)
        with torch.no_grad():
            init_weights(layer, config.num_layers, generator=layer_generator(seed, i, device))
    if tied_names(config):
        model.layers[-1].proj.weight = model.layers[0].tok.weight  # to_empty gave each its own tensor
    return model


def tied_names(config: ModelConfig) -> dict[str, str]:
    """Parameter names that are another parameter of the same model (tied weights): alias -> name.

    With ``tie_embeddings`` the output head's weight is the token embedding
    (GPT-2, Llama-3.2): ``{"layers.<last>.proj.weight": "layers.0.tok.weight"}``.
    One process holds one tensor under the name; a pipeline whose first and last
    stages differ holds a copy on each, kept equal by summing their gradients.
    """
    if config.kind == "vit" or not getattr(config, "tie_embeddings", False):
        return {}
    return {f"layers.{config.num_layers + 1}.proj.weight": "layers.0.tok.weight"}


def layer_generator(seed: int, layer: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator layer ``layer``'s initial weights come from."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + layer)


def rope_scaling(config: ModelConfig) -> RopeScaling | None:
    """Llama 3.1's rotary frequency scaling as ``config`` sets it; None when the factor is 1 (none)."""
    if config.rope_scale_factor == 1.0:
        return None
    return RopeScaling(
        factor=config.rope_scale_factor,
        low_freq_factor=config.rope_low_freq_factor,
        high_freq_factor=config.rope_high_freq_factor,
        original_context=config.rope_original_context,
    )


def _construct(config: ModelConfig, checkpoint_activations: bool, aux_loss_scale: float) -> nn.Module:
    if config.kind == "vit":
        return ViT(
            image_size=config.image_size,
            patch_size=config.patch_size,
            channels=config.channels,
            num_classes=config.num_classes,
            hidden=config.hidden,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            mlp_ratio=config.mlp_ratio,
            dropout=config.dropout,
            checkpoint_activations=checkpoint_activations,
            norm_eps=config.norm_eps,
        )
    if config.kind in ("gpt", "moe-gpt"):
        model = GPT(
            vocab_size=config.vocab_size,
            context_length=config.context_length,
            hidden=config.hidden,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            mlp_ratio=config.mlp_ratio,
            tie_embeddings=config.tie_embeddings,
            dropout=config.dropout,
            checkpoint_activations=checkpoint_activations,
            norm=config.norm,
            activation=config.activation,
            positions=config.positions,
            bias=config.bias,
            rope_theta=config.rope_theta,
            rope_scaling=rope_scaling(config),
            mlp_hidden=config.mlp_width,
            norm_eps=config.norm_eps,
        )
        if config.kind == "moe-gpt":
            moe = MoEConfig(
                hidden=config.hidden,
                ffn_hidden=config.mlp_ratio * config.hidden // config.top_k,  # about a dense MLP's active FLOPs
                num_experts=config.num_experts,
                top_k=config.top_k,
                capacity_factor=config.capacity_factor,
                aux_loss_coef=config.aux_loss_weight,
            )
            for block in model.layers[1:-1]:
                block.mlp = MoEMLP(moe, aux_loss_scale=aux_loss_scale)
        return model
    raise ValueError(f"unknown model.kind {config.kind!r}")  # ModelConfig already rejects it


__all__ = ["GPT", "ViT", "build_model", "tied_names"]
