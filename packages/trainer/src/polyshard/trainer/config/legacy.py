"""Every old spelling of a key outside ``[model]``, and where it lives now: read there with one note (a
saved config's quietly). ``[model]``'s old spellings are :mod:`polyshard.models.legacy`'s.

Up to 0.4 ``[training]`` held the optimizer, the learning-rate schedule and evaluation as well; they are
``[optimizer]``, ``[lr_schedule]`` and ``[eval]`` (0.2's ``training.schedule`` is ``lr_schedule.name`` too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyshard.models.settings import Note
from polyshard.trainer.errors import ConfigError

# (section, old key) -> (section, key) now.
MOVED: dict[tuple[str, str], tuple[str, str]] = {
    **{("training", key): ("optimizer", key) for key in (
        "lr", "weight_decay", "weight_decay_params", "beta1", "beta2", "grad_clip", "adamw_impl", "muon_momentum",
        "muon_nesterov", "muon_ns_steps", "idle_experts")},
    ("training", "optimizer"): ("optimizer", "name"),
    ("training", "schedule"): ("lr_schedule", "name"),
    ("training", "lr_schedule"): ("lr_schedule", "name"),
    **{("training", key): ("lr_schedule", key) for key in ("warmup_steps", "min_lr", "decay_fraction", "decay_shape")},
    ("training", "eval_every"): ("eval", "every"),
    ("training", "eval_batches"): ("eval", "batches"),
    ("training", "sample_tokens"): ("eval", "sample_tokens"),
}  # fmt: skip


def moved(raw: Mapping[str, Any], note: Note | None) -> dict[str, Any]:
    """``raw`` (a whole config's sections) with each old key in its section of today; ``note`` hears of
    each. A key given in both places is one setting twice: an error naming both."""
    out = {section: dict(values) if isinstance(values, Mapping) else values for section, values in raw.items()}
    for (section, old), (home, new) in MOVED.items():
        values = out.get(section)
        if not isinstance(values, dict) or old not in values:
            continue
        target = out.setdefault(home, {})
        if not isinstance(target, dict):
            continue  # named as not a table by the caller
        if new in target:
            raise ConfigError(f"{section}.{old} and {home}.{new} are one setting; keep {home}.{new}")
        target[new] = values.pop(old)
        if note is not None:
            note(f"note: {section}.{old} is now {home}.{new} (read as such)")
    return out
