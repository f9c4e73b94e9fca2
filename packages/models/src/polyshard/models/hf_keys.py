"""Which ``config.json`` key each ``[model]`` setting of a Hugging Face folder came from, and a setting's
message said in the folder's terms.

A folder's sizes are read into polyshard's settings by its family (:class:`polyshard.models.hf_adapter.HFAdapter`)
and then checked like any ``[model]`` table. A size no run can take is the file's fault, so its message
names the file and the key (``config.json: num_local_experts = 1000000000 is past 65,536 ...``), not a
``[model]`` field with a ``--set`` fix that cannot help.

The keys are found by reading the file once more with every integer tagged by its key
(:class:`_FromKey`, an ``int`` that remembers where it was read): the family's reader passes them through
unchanged, so each setting that holds one came from that key. Settings a reader computes (an MLP width
from a ratio) carry no key and keep their own name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from polyshard.models.hf_adapter import HFAdapter


class _FromKey(int):
    """An integer read from ``config.json``'s ``key``."""

    key: str

    def __new__(cls, value: int, key: str) -> _FromKey:
        tagged = super().__new__(cls, value)
        tagged.key = key
        return tagged


def _tagged(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``values`` with each integer (not bool) a :class:`_FromKey`; nested objects (rope_parameters) too."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = _FromKey(value, prefix + key)
        elif isinstance(value, Mapping):
            out[key] = _tagged(value, f"{prefix}{key}.")
        else:
            out[key] = value
    return out


def setting_keys(family: HFAdapter, hf: Mapping[str, Any], where: str) -> dict[str, str]:
    """``[model]`` setting -> the ``config.json`` key its value was read from (integers only)."""
    try:
        settings = family.settings(_tagged(hf), where)
    except Exception:  # noqa: BLE001  (the plain read passed; a reader that minds the tags names nothing)
        return {}
    return {name: value.key for name, value in settings.items() if isinstance(value, _FromKey)}


def in_folder_terms(message: str, keys: Mapping[str, str], where: str) -> str:
    """A ``[model]`` setting's ``message`` said of the folder: each ``model.<setting>`` read from a key named
    as that key, ``--set`` fixes dropped (the file is what to change), and ``where`` (its config.json) first."""
    for name in sorted(keys, key=len, reverse=True):  # moe.shared_ffn_hidden before moe.ffn_hidden
        field = re.escape(f"model.{name}")
        message = re.sub(rf"{field}=(?=\S)", f"{keys[name]} = ", message)
        message = re.sub(rf"{field}(?![\w.])", keys[name], message)
    kept = [part for part in message.split("; ") if "--set" not in part]
    return f"{where}: {'; '.join(kept)}; correct {where} or use another folder"
