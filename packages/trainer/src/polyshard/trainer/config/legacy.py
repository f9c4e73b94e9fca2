"""Every old spelling of a training section's key, and its new name: read under the new one with one note
(a saved config's quietly). ``[model]``'s old spellings are :mod:`polyshard.models.legacy`'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyshard.models.settings import Note
from polyshard.trainer.errors import ConfigError

# Keys renamed since 0.2: (section, old) -> new.
RENAMED = {("training", "schedule"): "lr_schedule"}


def renamed(section: str, values: Mapping[str, Any], note: Note | None) -> dict[str, Any]:
    """``values`` (a ``[section]`` table) with each old key under its new name; ``note`` hears of each."""
    out = dict(values)
    for (where, old), new in RENAMED.items():
        if where == section and old in out:
            if new in out:
                raise ConfigError(f"{section}.{old} and {section}.{new} are one setting; keep {section}.{new}")
            out[new] = out.pop(old)
            if note is not None:
                note(f"note: {section}.{old} is now {section}.{new} (read as such)")
    return out
