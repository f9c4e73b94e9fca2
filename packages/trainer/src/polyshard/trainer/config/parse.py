"""Reading settings: TOML files and ``--set section.key=value`` overrides into the dataclasses of
:mod:`.sections`. Parsing is strict: an unknown section or key is an error that names it and
suggests the nearest known one; every value is checked for its field's type (NaN and infinities
included), and an override parses with its field's type.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

from polyshard.trainer.config.sections import PRESETS, SECTIONS, Config, _check_positive
from polyshard.trainer.errors import ConfigError


def _unknown(kind: str, key: str, known: Sequence[str]) -> ConfigError:
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f"; known: {sorted(known)}"
    return ConfigError(f"unknown {kind} {key!r}{hint}")


# -- types ---------------------------------------------------------------------
_TYPE_WORDS = {
    "int": "an integer",
    "float": "a finite number",
    "bool": "true or false",
    "str": "a string",
    "list[int]": "a list of integers",
    "list[WeightedSource]": "a list of tables",
}


def _field_type(section: str, key: str) -> str | None:
    """The declared type of ``section.key`` as written ('int', 'float | None', 'list[int] | None')."""
    cls = SECTIONS.get(section)
    fields = {f.name: f.type for f in dataclasses.fields(cls)} if cls else {}
    annotation = fields.get(key)
    return annotation if isinstance(annotation, str) or annotation is None else annotation.__name__


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
    if kind == "list[WeightedSource]":  # each entry is checked by DataConfig itself
        return isinstance(value, list)
    raise AssertionError(f"config field type {kind!r} has no check")  # a new field type needs one here


def check_type(section: str, key: str, value: Any) -> Any:
    """``value`` as ``section.key``'s declared type (an int where a float is declared becomes a float);
    a :class:`ConfigError` naming the field and the expected type otherwise. NaN and infinities are
    never valid numbers."""
    declared = _field_type(section, key)
    if declared is None:
        return value
    kinds = [k.strip() for k in declared.split("|")]
    if value is None and "None" in kinds:
        return None
    for kind in (k for k in kinds if k != "None"):
        if _fits(value, kind):
            return float(value) if kind == "float" else value
    wanted = " or ".join(_TYPE_WORDS.get(k, "unset") for k in kinds)
    raise ConfigError(f"{section}.{key}={value!r} must be {wanted}")


# -- parsing -------------------------------------------------------------------
_BOOLS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False, "on": True, "off": False}


def _parse_value(text: str, declared: str | None = None) -> Any:
    """An override's value as the field's type: a bool from true/false/1/0 in any case, else a TOML
    value (3e-4, "x", [1, 2]); a bare word stays a string (for string fields)."""
    if declared is not None and declared.split("|")[0].strip() == "bool" and text.lower() in _BOOLS:
        return _BOOLS[text.lower()]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings to a raw config dict (a new dict is returned)."""
    # A top-level key that is no table (steps = 5 above every [section]) stays as it is: from_dict names it.
    out = {section: dict(values) if isinstance(values, Mapping) else values for section, values in raw.items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. training.lr=3e-4")
        path, value = item.split("=", 1)
        if path.count(".") != 1:
            raise ConfigError(f"override {path!r} must name section.key, e.g. training.lr")
        section, key = path.split(".")
        out.setdefault(section, {})[key] = _parse_value(value.strip(), _field_type(section, key))
    return out


def auto_dp(parallel: Mapping[str, Any], world_size: int | None) -> int:
    """``parallel.dp = "auto"``: the processes left after the other axes, ``world_size / (tp x pp x ep x cp)``."""
    others: dict[str, int] = {axis: parallel.get(axis, 1) for axis in ("tp", "pp", "ep", "cp")}
    for axis, size in others.items():
        _check_positive(f"parallel.{axis}", size)
    if world_size is None:
        raise ConfigError("parallel.dp='auto' needs the number of processes; give --nproc")
    rest = math.prod(others.values())
    if world_size % rest:
        raise ConfigError(
            f"parallel.dp='auto': {world_size} processes do not split into tp x pp x ep x cp = {rest}; "
            f"run a multiple of {rest} processes"
        )
    return world_size // rest


def from_dict(raw: Mapping[str, Any], world_size: int | None = None) -> Config:
    """Build a :class:`Config`; unknown sections or keys are errors with a suggestion. ``world_size``
    (the processes present) resolves ``parallel.dp = "auto"``."""
    sections = {}
    for section, values in raw.items():
        if section not in SECTIONS and not isinstance(values, Mapping):
            homes = [name for name, cls in SECTIONS.items() if section in {f.name for f in dataclasses.fields(cls)}]
            where = f"; put it under [{homes[0]}]" if homes else ""
            raise ConfigError(f"{section} = {values!r} stands outside any [section]{where}")
        if section not in SECTIONS:
            raise _unknown("config section", section, list(SECTIONS))
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{section}] must be a table of key = value pairs, not {values!r}")
        cls = SECTIONS[section]
        known = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in known:
                raise _unknown(f"key in [{section}]", key, known)
        if section == "parallel" and values.get("dp") == "auto":
            values = {**values, "dp": auto_dp(values, world_size)}
        values = {key: check_type(section, key, value) for key, value in values.items()}
        if section == "model" and values.get("preset") in PRESETS:
            values = {**PRESETS[values["preset"]], **values}  # explicit keys override the preset
        try:
            sections[section] = cls(**values)
        except TypeError as err:  # pragma: no cover - fields are checked above
            raise ConfigError(f"[{section}]: {err}") from err
    return Config(**sections)


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, world_size: int | None = None
) -> Config:
    """Read a TOML file (or the defaults when ``path`` is None) and apply overrides; ``world_size``
    resolves ``parallel.dp = "auto"``."""
    raw = read_toml(path) if path is not None else {}
    return from_dict(apply_overrides(raw, overrides), world_size)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's tables, as written (checked by :func:`from_dict`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from err
