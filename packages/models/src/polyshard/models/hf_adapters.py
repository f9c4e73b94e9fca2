"""Every family's Hugging Face adapters by ``model_type``, and the adapter a model's architecture maps to."""

from __future__ import annotations

from polyshard.checkpoint import CheckpointError
from polyshard.models.build import spec_of
from polyshard.models.config import ModelConfig
from polyshard.models.hf_adapter import HFAdapter
from polyshard.models.registry import SPECS


def hf_adapters() -> dict[str, HFAdapter]:
    """The adapters of every registered family, by the ``model_type`` of a Hugging Face ``config.json``."""
    return {family.model_type: family for spec in SPECS.values() for family in spec.hf_adapters}


def hf_adapter_of(model: ModelConfig) -> HFAdapter:
    """The family whose architecture ``model`` has; an error naming what each would need otherwise."""
    allowed = spec_of(model).hf_adapters
    if not allowed:
        raise CheckpointError(f"model.kind={model.kind!r} has no Hugging Face counterpart polyshard reads or writes")
    needs = {}
    for family in allowed:
        differences = family.differences(model)
        if not differences:
            return family
        needs[family.title] = ", ".join(f"{k}={v!r}" for k, v in differences.items())
    raise CheckpointError(
        f"the Hugging Face export writes {' and '.join(family.title for family in allowed)} models of "
        f"model.kind={model.kind!r}; this model is none of them: "
        + "; ".join(f"{title} would need {what}" for title, what in needs.items())
    )
