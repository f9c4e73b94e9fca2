"""Reading ``[model]``: the family it names, that family's fields only, each value of its field's type,
and 0.2's flat spellings (one ``[model]`` table for every family) read with a note naming the new one.

A run folder's or a checkpoint's saved config (``saved=True``) lists every field 0.2 had, a family's own
and the others' (at their defaults, or values that family never read): those others are dropped quietly,
since they never did anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from typing import Any

from polyshard.models.common.moe import LEGACY_NAMES, MoEConfig
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.registry import SPECS

Note = Callable[[str], None]

# 0.2's one flat [model] section: every field and its default (saved configs hold them all).
LEGACY_DEFAULTS: dict[str, object] = {
    "vocab_size": 256, "context_length": 64, "num_kv_heads": None, "tie_embeddings": False, "norm": "layer",
    "activation": "gelu", "positions": "learned", "bias": True, "rope_theta": 10000.0, "rope_scale_factor": 1.0,
    "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_context": 8192, "mlp_hidden": None,
    "head_dim": None, "qkv_bias": None, "qk_norm": False, "num_experts": 4, "top_k": 2, "capacity_factor": None,
    "aux_loss_weight": 0.01, "expert_hidden": None, "router_renormalize": True, "shared_experts": 0,
    "shared_expert_hidden": None, "shared_expert_gate": False, "router": "softmax", "router_bias_update_rate": 0.0,
    "router_groups": 1, "router_group_topk": 1, "router_scale": 1.0, "seq_aux_loss_weight": 0.0,
    "router_z_loss_weight": 0.0, "image_size": 8, "patch_size": 2, "channels": 1, "num_classes": 10,
}  # fmt: skip

# -- values of a declared type -------------------------------------------------------------------------
_TYPE_WORDS = {
    "int": "an integer",
    "float": "a finite number",
    "bool": "true or false",
    "str": "a string",
    "list[int]": "a list of integers",
    "list[str]": "a list of strings",
    "list[WeightedSource]": "a list of tables",
    "list[RewardSpec]": "a list of tables",
}


def _fits(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "str":
        return isinstance(value, str)
    if kind == "list[int]":
        return isinstance(value, list) and all(_fits(v, "int") for v in value)
    if kind == "list[str]":
        return isinstance(value, list) and all(_fits(v, "str") for v in value)
    if kind in ("list[WeightedSource]", "list[RewardSpec]"):  # each entry is checked by its section itself
        return isinstance(value, list)
    raise AssertionError(f"config field type {kind!r} has no check")  # a new field type needs one here


def declared_type(cls: type, key: str) -> str | None:
    """The declared type of ``cls``'s field ``key`` as written ('int', 'float | None'); None if it has none."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    annotation = fields.get(key)
    return annotation if isinstance(annotation, str) or annotation is None else annotation.__name__


def check_value(name: str, declared: str | None, value: Any) -> Any:
    """``value`` as the declared type (an int where a float is declared becomes a float); a
    :class:`ConfigError` naming the field ``name`` and the expected type otherwise. NaN and infinities are
    never valid numbers."""
    if declared is None:
        return value
    kinds = [k.strip() for k in declared.split("|")]
    if value is None and "None" in kinds:
        return None
    for kind in (k for k in kinds if k != "None"):
        if _fits(value, kind):
            return float(value) if kind == "float" else value
    wanted = " or ".join(_TYPE_WORDS.get(k, "unset") for k in kinds)
    raise ConfigError(f"{name}={value!r} must be {wanted}")


def unknown(kind: str, key: str, known: list[str]) -> ConfigError:
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f"; known: {sorted(known)}"
    return ConfigError(f"unknown {kind} {key!r}{hint}")


# -- [model] -------------------------------------------------------------------------------------------


def presets() -> dict[str, tuple[str, Mapping[str, Any]]]:
    """Every family's presets: name -> (kind, settings)."""
    return {name: (spec.kind, values) for spec in SPECS.values() for name, values in spec.presets.items()}


def family_class(values: Mapping[str, Any]) -> type[ModelConfig]:
    """The config class of the family ``values`` (a ``[model]`` table) names, by kind or preset."""
    return SPECS[_kind(values)].config


def _kind(values: Mapping[str, Any]) -> str:
    kind = values.get("kind")
    preset = values.get("preset")
    if kind is None and isinstance(preset, str) and preset in presets():
        kind = presets()[preset][0]
    kind = "gpt" if kind is None else kind
    if not isinstance(kind, str) or kind not in SPECS:
        raise ConfigError(f"model.kind={kind!r}; choose one of {list(SPECS)}")
    return kind


def field_type(values: Mapping[str, Any], path: str) -> str | None:
    """The declared type of ``path`` ('num_heads', 'moe.top_k') in the family ``values`` names; None if
    unknown (the caller's parse then names the key)."""
    try:
        cls: type = family_class(values)
    except ConfigError:
        return None
    *tables, key = path.split(".")
    for table in tables:
        nested = {f.name: f for f in dataclasses.fields(cls)}.get(table)
        if nested is None or not isinstance(nested.default_factory, type):
            return None
        cls = nested.default_factory
    return declared_type(cls, key)


def model_config(values: Mapping[str, Any], *, saved: bool = False, note: Note | None = None) -> ModelConfig:
    """The family config ``values`` (a ``[model]`` table) describes. ``saved``: a config written by an
    earlier run (0.2's every-field dump allowed); ``note`` receives one line per old spelling read."""
    preset = values.get("preset")
    if preset is not None and preset not in presets():
        raise ConfigError(f"model.preset={preset!r}; choose one of {list(presets())}")
    kind = _kind(values)
    spec = SPECS[kind]
    cls = spec.config
    fields = cls.field_names()
    own = _translated(dict(values), kind, fields, saved=saved, note=note)
    for key in own:
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1, cutoff=0.75)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(
                f"model.{key} is not a setting of model.kind={kind!r}; {hint}its settings are: {', '.join(fields)}"
            )
    checked = {k: v if k == "moe" else check_value(f"model.{k}", declared_type(cls, k), v) for k, v in own.items()}
    base = dict(presets()[preset][1]) if isinstance(preset, str) else {}
    base.pop("kind", None)
    merged = {**base, **checked, "kind": kind}
    if "moe" in fields:
        merged["moe"] = _moe({**base.get("moe", {}), **_table("moe", checked.get("moe", {}))}, _default_moe(cls))
    elif "moe" in base:
        raise ConfigError(f"model.preset={preset!r} has experts; model.kind={kind!r} has none")
    return cls(**merged)


def _table(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, MoEConfig):
        return dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"model.{name} must be a table of key = value pairs ([model.{name}]), not {value!r}")
    return dict(value)


def _default_moe(cls: type) -> MoEConfig:
    """The family's own ``[model.moe]`` defaults (gpt-oss's router and experts differ from Mixtral's)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == "moe")
    made = field.default_factory() if field.default_factory is not dataclasses.MISSING else MoEConfig()
    return made if isinstance(made, MoEConfig) else MoEConfig()


def _moe(values: dict[str, Any], default: MoEConfig | None = None) -> MoEConfig:
    known = [f.name for f in dataclasses.fields(MoEConfig)]
    for key in values:
        if key not in known:
            raise unknown("key in [model.moe]", key, known)
    checked = {k: check_value(f"model.moe.{k}", declared_type(MoEConfig, k), v) for k, v in values.items()}
    return dataclasses.replace(default, **checked) if default is not None else MoEConfig(**checked)


def _translated(
    values: dict[str, Any], kind: str, fields: list[str], *, saved: bool, note: Note | None
) -> dict[str, Any]:
    """``values`` with 0.2's flat spellings moved to where ``kind``'s config holds them."""
    out: dict[str, Any] = {}
    moe: dict[str, Any] = dict(_table("moe", values.pop("moe"))) if "moe" in values else {}
    for key, value in values.items():
        if key.startswith("moe.") and "moe" in fields:  # a dotted key, as TOML's moe.top_k = 2
            moe[key.removeprefix("moe.")] = value
        elif key in fields:
            out[key] = value
        elif key in LEGACY_NAMES and "moe" in fields:
            new = LEGACY_NAMES[key]
            if new in moe:
                raise ConfigError(f"model.{key} and model.moe.{new} are one setting; keep model.moe.{new}")
            moe[new] = value
            if note is not None and not saved:
                note(f"note: model.{key} is now model.moe.{new} (read as such)")
        elif saved and key in LEGACY_DEFAULTS:
            continue  # 0.2 saved every family's fields in one table; this family never read this one
        else:
            out[key] = value  # named as not a setting of the family by the caller
    if moe:
        out["moe"] = moe
    return out


def with_folder_settings(values: Mapping[str, Any], folder: Mapping[str, Any]) -> dict[str, Any]:
    """A ``[model]`` table (``values``) completed by ``folder``'s settings (dotted keys, ``moe.top_k``,
    as a Hugging Face folder's ``config.json`` gives them): every setting the table leaves unset, by
    itself or through its preset, takes the folder's value. What the table does set is kept as it is
    (the caller then checks it against the folder). The result names each setting once, in the new
    spellings, the preset expanded, experts in a nested ``moe`` table."""
    kind = values.get("kind")
    preset = values.get("preset")
    if kind is None and not (isinstance(preset, str) and preset in presets()):
        kind = folder.get("kind")
    chosen = {**values, "kind": kind} if kind is not None else dict(values)
    kind = _kind(chosen)
    if folder.get("kind") is not None and kind != folder["kind"]:  # another family's settings would not fit
        raise ConfigError(
            f"model.kind={kind!r} here (by kind or preset), {folder['kind']!r} in the folder; leave model.kind "
            "and model.preset out of [model] to train the folder's model"
        )
    fields = SPECS[kind].config.field_names()
    chosen.pop("preset", None)
    base = dict(presets()[preset][1]) if isinstance(preset, str) and preset in presets() else {}
    own = _translated(chosen, kind, fields, saved=False, note=None)
    given = {**_flat(base), **_flat(own)}  # what the table sets, its preset's values first
    merged = {**{k: v for k, v in folder.items() if k != "kind"}, **given, "kind": kind}
    out: dict[str, Any] = {}
    for key, value in merged.items():
        table, _, name = key.rpartition(".")
        if table:
            out.setdefault(table, {})[name] = value
        else:
            out[key] = value
    return out


def _flat(values: Mapping[str, Any]) -> dict[str, Any]:
    """A ``[model]`` table's settings as dotted keys (``{"moe": {"top_k": 2}}`` -> ``{"moe.top_k": 2}``)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "moe":
            out |= {f"moe.{k}": v for k, v in _table("moe", value).items()}
        else:
            out[key] = value
    return out
