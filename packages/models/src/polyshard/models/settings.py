"""Reading ``[model]``: the family it names, that family's fields only, each value of its field's type,
its sub-tables (``[model.moe]``, ``[model.rope]``), and earlier versions' flat spellings
(:mod:`polyshard.models.legacy`) read with a note naming the new one.

A run folder's or a checkpoint's saved config (``saved=True``) lists every field 0.2 had, a family's own
and the others' (at their defaults, or values that family never read): those others are dropped quietly,
since they never did anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from typing import Any, cast

from polyshard.models.common.moe import MoEConfig
from polyshard.models.common.rotary import RopeConfig
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.legacy import LEGACY_DEFAULTS, LEGACY_KEYS, legacy_rope
from polyshard.models.registry import SPECS

Note = Callable[[str], None]

# The sub-tables of [model] (a family holds those its config declares): name -> their settings' class.
TABLES: dict[str, type] = {"moe": MoEConfig, "rope": RopeConfig}

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
        if table not in TABLES or table not in {f.name for f in dataclasses.fields(cls)}:
            return None
        cls = TABLES[table]
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
    checked = {k: v if k in TABLES else check_value(f"model.{k}", declared_type(cls, k), v) for k, v in own.items()}
    base = dict(presets()[preset][1]) if isinstance(preset, str) else {}
    base.pop("kind", None)
    merged = {**base, **checked, "kind": kind}
    for name in TABLES:
        if name in fields:
            merged[name] = _sub_config(name, {**base.get(name, {}), **_table(name, checked.get(name, {}))}, cls)
        elif name in base:
            raise ConfigError(f"model.preset={preset!r} sets [model.{name}]; model.kind={kind!r} has none")
    return cls(**merged)


def _table(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, TABLES[name]):
        return dataclasses.asdict(cast(Any, value))
    if not isinstance(value, Mapping):
        raise ConfigError(f"model.{name} must be a table of key = value pairs ([model.{name}]), not {value!r}")
    return dict(value)


def family_default(cls: type, name: str) -> Any:
    """The family's own ``[model.<name>]`` defaults (gpt-oss's router and rotary scaling differ from Mixtral's)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else TABLES[name]()


def _sub_config(name: str, values: dict[str, Any], cls: type) -> Any:
    """``[model.<name>]``: the family's defaults with ``values`` set, each of its field's type."""
    table = TABLES[name]
    known = [f.name for f in dataclasses.fields(table)]
    for key in values:
        if key not in known:
            raise unknown(f"key in [model.{name}]", key, known)
    checked = {k: check_value(f"model.{name}.{k}", declared_type(table, k), v) for k, v in values.items()}
    return dataclasses.replace(family_default(cls, name), **checked)


def _translated(
    values: dict[str, Any], kind: str, fields: list[str], *, saved: bool, note: Note | None
) -> dict[str, Any]:
    """``values`` with the flat spellings of earlier versions moved to the tables where ``kind``'s config
    holds them, and dotted keys (TOML's ``moe.top_k = 2``) into theirs."""
    out: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {
        name: dict(_table(name, values.pop(name))) for name in TABLES if name in values
    }
    legacy: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        table, _, name = key.partition(".")
        if name and table in TABLES and table in fields:
            tables.setdefault(table, {})[name] = value
        elif key in fields:
            out[key] = value
        elif key in LEGACY_KEYS and LEGACY_KEYS[key][0] in fields:
            table, new = LEGACY_KEYS[key]
            legacy.setdefault(table, {})[new] = value
            if note is not None and not saved:
                note(f"note: model.{key} is now model.{table}.{new} (read as such)")
        elif saved and (key in LEGACY_DEFAULTS or key in LEGACY_KEYS):
            continue  # 0.2 saved every family's fields in one table; this family never read this one
        else:
            out[key] = value  # named as not a setting of the family by the caller
    if "rope" in legacy:
        family = family_default(SPECS[kind].config, "rope")
        legacy["rope"] = legacy_rope(legacy["rope"], tables.get("rope", {}), family)
    for table, moved in legacy.items():
        both = sorted(set(moved) & set(tables.get(table, {})))  # the new spelling given too, in any order
        if both:
            old = next(k for k, (t, new) in LEGACY_KEYS.items() if t == table and new == both[0])
            raise ConfigError(f"model.{old} and model.{table}.{both[0]} are one setting; keep model.{table}.{both[0]}")
        tables[table] = {**tables.get(table, {}), **moved}
    return {**out, **{name: table for name, table in tables.items() if table}}


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
        if key in TABLES:
            out |= {f"{key}.{k}": v for k, v in _table(key, value).items()}
        else:
            out[key] = value
    return out
