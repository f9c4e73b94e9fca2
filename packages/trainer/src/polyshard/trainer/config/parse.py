"""Reading settings: TOML files and ``--set section.key=value`` overrides into the dataclasses of
:mod:`.sections`. Parsing is strict: an unknown section or key is an error that names it and
suggests the nearest known one; every value is checked for its field's type (NaN and infinities
included), and an override parses with its field's type.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

from polyshard.models.errors import check_positive as _check_positive
from polyshard.models.settings import Note, check_value, declared_type, field_type, model_config, unknown
from polyshard.trainer.config.legacy import moved
from polyshard.trainer.config.rules import check_sections
from polyshard.trainer.config.sections import SECTIONS, Config
from polyshard.trainer.errors import ConfigError

# -- types ---------------------------------------------------------------------


def _field_type(section: str, key: str, raw: Mapping[str, Any] | None = None) -> str | None:
    """The declared type of ``section.key`` as written ('int', 'float | None', 'list[int] | None'); a
    ``[model]`` key's in the family ``raw``'s model table names (``key`` may be dotted: ``moe.top_k``)."""
    if section == "model":
        return field_type(raw.get("model", {}) if raw is not None else {}, key)
    cls = SECTIONS.get(section)
    return declared_type(cls, key) if cls is not None and key in {f.name for f in dataclasses.fields(cls)} else None


def check_type(section: str, key: str, value: Any) -> Any:
    """``value`` as ``section.key``'s declared type (an int where a float is declared becomes a float);
    a :class:`ConfigError` naming the field and the expected type otherwise. NaN and infinities are
    never valid numbers."""
    return check_value(f"{section}.{key}", _field_type(section, key), value)


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
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. optimizer.lr=3e-4")
        path, value = item.split("=", 1)
        if path.count(".") != 1 and not (path.startswith("model.") and path.count(".") == 2):
            raise ConfigError(f"override {path!r} must name section.key, e.g. optimizer.lr (or model.moe.key)")
        section, key = path.split(".", 1)
        parsed = _parse_value(value.strip(), _field_type(section, key, out))
        if "." in key:  # model.moe.top_k: a key of the model's nested table
            table, key = key.split(".")
            nested = out.setdefault(section, {}).get(table, {})
            out[section][table] = {**nested, key: parsed} if isinstance(nested, Mapping) else {key: parsed}
        else:
            out.setdefault(section, {})[key] = parsed
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


def from_dict(
    raw: Mapping[str, Any], world_size: int | None = None, *, saved: bool = False, note: Note | None = None
) -> Config:
    """Build a :class:`Config`; unknown sections or keys are errors with a suggestion. ``world_size``
    (the processes present) resolves ``parallel.dp = "auto"``. ``saved``: a config an earlier run wrote
    (0.2's every-field ``[model]`` read); ``note`` receives one line per old spelling read."""
    sections: dict[str, Any] = {}
    for section, values in moved(raw, None if saved else note).items():
        if values is None and section in ("lora", "dpo", "grpo"):  # a saved config's "none" (TOML has no null)
            continue
        if section not in SECTIONS and not isinstance(values, Mapping):
            homes = [name for name, cls in SECTIONS.items() if section in {f.name for f in dataclasses.fields(cls)}]
            where = f"; put it under [{homes[0]}]" if homes else ""
            raise ConfigError(f"{section} = {values!r} stands outside any [section]{where}")
        if section not in SECTIONS:
            raise unknown("config section", section, list(SECTIONS))
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{section}] must be a table of key = value pairs, not {values!r}")
        if section == "model":  # the family's own fields, read by polyshard.models
            sections[section] = model_config(values, saved=saved, note=note)
            continue
        cls = SECTIONS[section]
        known = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in known:
                raise unknown(f"key in [{section}]", key, known)
        if section == "data" and values.get("sources") is not None and "source" in values:
            raise ConfigError(
                "data.source and data.sources are both set; a run reads one source or a mixture: "
                "drop data.source, or drop [[data.sources]]"
            )
        if section == "parallel" and values.get("dp") == "auto":
            values = {**values, "dp": auto_dp(values, world_size)}
        values = {key: check_type(section, key, value) for key, value in values.items()}
        try:
            sections[section] = cls(**values)
        except TypeError as err:  # pragma: no cover - fields are checked above
            raise ConfigError(f"[{section}]: {err}") from err
    config = Config(**sections)
    check_sections(config)
    return config


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
