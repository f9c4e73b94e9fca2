"""Every model family by ``model.kind``. A family is a folder with its spec; adding one is a line here,
or, from outside this package, :func:`register` (a test's family) or an entry point in the group
``polyshard.models`` naming its :class:`~polyshard.models.spec.ModelSpec` (a family in its own
distribution, found by every process, torchrun's workers included)."""

from __future__ import annotations

from importlib.metadata import entry_points

from polyshard.models.deepseek_v3.model import SPEC as DEEPSEEK_V3_SPEC
from polyshard.models.errors import ConfigError
from polyshard.models.gpt.model import SPEC as GPT_SPEC
from polyshard.models.gpt_oss.model import SPEC as GPT_OSS_SPEC
from polyshard.models.moe_gpt.model import SPEC as MOE_GPT_SPEC
from polyshard.models.spec import ModelSpec
from polyshard.models.vit.model import SPEC as VIT_SPEC

SPECS: dict[str, ModelSpec] = {
    spec.kind: spec for spec in (GPT_SPEC, MOE_GPT_SPEC, GPT_OSS_SPEC, DEEPSEEK_V3_SPEC, VIT_SPEC)
}
"""The families this package holds, then those registered."""


def register(spec: ModelSpec) -> None:
    """Make ``spec``'s family buildable and trainable as ``model.kind = spec.kind`` in this process."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register takes a ModelSpec, not {type(spec).__name__}")
    if spec.kind in SPECS and SPECS[spec.kind] is not spec:
        raise ConfigError(f"model.kind={spec.kind!r} is already a family; give the new one another kind")
    SPECS[spec.kind] = spec


def _load_entry_points() -> None:
    for point in entry_points(group="polyshard.models"):
        spec = point.load()
        register(spec)


_load_entry_points()
