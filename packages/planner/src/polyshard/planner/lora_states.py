"""What a LoRA run (``[lora]``) changes in the model states a rank holds: the adapters' two factors are
parameters of their own (A (r, in), B (out, r) under their linear's name; with ``lora.experts`` the routed
experts' (E, in, r) and (E, r, out) beside each stacked weight, split over ep as it is), and every other parameter is
frozen, held in its bytes alone: bf16 under mixed precision, ``model.frozen_dtype`` for the modules
holding a matrix (:mod:`polyshard.trainer.engine.frozen_dtype`), float32 otherwise."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from polyshard.models import build_model
from polyshard.models.common.lora import is_adapter
from polyshard.models.common.moe.lora import EXPERT_WEIGHTS, expert_adapter_shapes
from polyshard.models.config import ModelConfig
from polyshard.trainer.config import Config
from polyshard.trainer.engine.lora import lora_targets


def adapter_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """Every adapter factor's global shape by name (none without ``[lora]``)."""
    if config.lora is None:
        return {}
    rank = config.lora.rank
    shapes: dict[str, tuple[int, ...]] = {}
    for target in lora_targets(config):
        shapes[f"{target.name}.lora_A.weight"] = (rank, target.in_features)
        shapes[f"{target.name}.lora_B.weight"] = (target.out_features, rank)
    if config.lora.experts:  # every routed expert's: (E, in, r) and (E, r, out) beside each stacked weight
        for layer, weights in _stacked_experts(config.model).items():
            shapes |= expert_adapter_shapes(layer, weights, rank)
    return shapes


def _stacked_experts(model: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Each MoE layer's stacked expert weights (``w1``, ``w3``, ``w2``: (E, in, out)) by the layer's name, from
    a build on the meta device; cached by the model's repr (a list field leaves the config unhashable)."""
    key = repr(model)
    if key not in _EXPERTS:
        if len(_EXPERTS) >= 32:
            _EXPERTS.clear()
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, param in build_model(model, layers=()).named_parameters():
            layer, _, weight = name.rpartition(".experts.")
            if layer and weight in EXPERT_WEIGHTS:
                out.setdefault(layer, {})[weight] = tuple(param.shape)
        _EXPERTS[key] = out
    return _EXPERTS[key]


_EXPERTS: dict[str, dict[str, dict[str, tuple[int, ...]]]] = {}


def frozen_bytes(config: Config, name: str, matrix_modules: Collection[str]) -> int | None:
    """Bytes per element of parameter ``name`` if a LoRA run freezes it (None: it trains); ``matrix_modules``:
    the modules holding a matrix, kept in ``model.frozen_dtype`` whole (a linear's bias with its weight)."""
    if config.lora is None or is_adapter(name):
        return None
    if config.training.precision == "bf16":
        return 2
    if config.model.frozen_dtype is None:
        return 4
    return 2 if name.rsplit(".", 1)[0] in matrix_modules else 4


def matrix_modules(shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """The modules (parameter names less their last part) that hold a parameter of two or more dims."""
    return {name.rsplit(".", 1)[0] for name, shape in shapes.items() if len(shape) >= 2}
