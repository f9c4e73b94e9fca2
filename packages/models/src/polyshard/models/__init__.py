"""polyshard.models: the model families polyshard trains, as plain PyTorch modules with no parallelism
inside. :mod:`.common` holds the blocks every family shares and :mod:`.decoder` the parts a decoder
family's settings are made of (its attention, its experts, ``[model.rope]``); each family is a folder
(:mod:`.gpt`, :mod:`.moe_gpt`, :mod:`.gpt_oss`, :mod:`.deepseek_v3`, :mod:`.vit`) with its config, model,
parallel plan, Hugging Face adapters and presets, declared by one :class:`ModelSpec` in :mod:`.registry`.
:func:`load` rebuilds a model that ``polyshard export`` wrote (:mod:`.exported`)."""

from polyshard.models.build import (
    active_parameter_count,
    active_share,
    build_model,
    check_model,
    layer_generator,
    output_width,
    parameter_count,
    sequence_length,
    spec_of,
    tied_names,
)
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.exported import export_metadata, load
from polyshard.models.gpt.model import GPT
from polyshard.models.registry import SPECS, register
from polyshard.models.spec import BuildOptions, ModelSpec, ParallelSizes, layer_of
from polyshard.models.vit.model import ViT

__all__ = [
    "GPT",
    "SPECS",
    "BuildOptions",
    "ConfigError",
    "ModelConfig",
    "ModelSpec",
    "ParallelSizes",
    "ViT",
    "active_parameter_count",
    "active_share",
    "build_model",
    "check_model",
    "export_metadata",
    "layer_generator",
    "layer_of",
    "load",
    "output_width",
    "parameter_count",
    "register",
    "sequence_length",
    "spec_of",
    "tied_names",
]
