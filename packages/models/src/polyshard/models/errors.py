"""The typed error of a setting that cannot run, and the small checks every config section uses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and says what would work."""


class MoEConfigError(ConfigError):
    """``[model.moe]`` settings that cannot work (expert count, top-k, capacity...), read from a config or
    given to a layer built by hand."""


def check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")


def check_at_least(name: str, value: float, low: float) -> None:
    if not value >= low:
        raise ConfigError(f"{name}={value!r} must be >= {low}")


def check_choice(name: str, value: Any, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}; choose one of {list(choices)}")
