"""What one Hugging Face model family declares, and typed reads of its untrusted ``config.json``.

A :class:`HFAdapter` is a small record of functions: ``config.json`` -> polyshard's ``[model]``
settings, our parameter names -> where each lives in the family's files, and back. The reader
and writer in :mod:`polyshard.trainer.checkpointing.hugging_face` know nothing of any one family; a model-spec
registry can point a model kind at one of these records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from polyshard.checkpoint import CheckpointError, TensorLocation
from polyshard.models.common.rotary import RopeConfig
from polyshard.models.config import ModelConfig


@dataclass(frozen=True)
class HFAdapter:
    """One Hugging Face model family polyshard reads and writes."""

    model_type: str
    """``config.json``'s model_type, e.g. ``llama``."""
    title: str
    """The family's name in messages, e.g. ``Llama``."""
    settings: Callable[[Mapping[str, Any], str], dict[str, object]]
    """A validated ``config.json`` (its path for messages) -> polyshard's ``[model]`` settings."""
    # The functions below take the family's own config class (GPTConfig, MoEGPTConfig), hence Any: the
    # reader and writer call them only with a model of the spec that lists this family.
    differences: Callable[[Any], dict[str, object]]
    """The settings a model would need to change to be of this family (empty: it is)."""
    locations: Callable[[Any], dict[str, TensorLocation]]
    """Our parameter name -> where it lives in the family's files."""
    config: Callable[[Any], dict[str, object]]
    """The ``config.json`` written for a model of this family."""
    base_prefix: str
    """The prefix the causal-LM class adds to the base model's names (``transformer.``, ``model.``)."""
    base_names: tuple[str, ...]
    """Name starts of a base-model file (the Hub's ``gpt2``), read as if they had ``base_prefix``."""
    buffers: tuple[str, ...] = ()
    """Name ends of saved buffers that hold no weights (skipped when reading)."""
    at_most: frozenset[str] = field(default_factory=frozenset)
    """Settings ours may undershoot: a model may train on sequences shorter than the folder's context."""
    note: Callable[[Any], str | None] = lambda model: None
    """What an export of ``model`` in this family's format should tell its user (None: nothing)."""

    def canonical(self, name: str) -> str:
        return self.base_prefix + name if name.startswith(self.base_names) else name


_EFFECTIVE = {
    "num_kv_heads": "kv_heads",
    "mlp_hidden": "mlp_width",
    "head_dim": "attention_head_dim",
    "qkv_bias": "qkv_biased",
    "moe.ffn_hidden": "expert_width",
}


# Every Hugging Face family polyshard writes attends to the whole causal context without sinks: a model
# with sliding windows or sinks has no file of those families, so export refuses it by naming these.
FULL_ATTENTION: dict[str, object] = {"sliding_window": None, "attention_sinks": False}


def setting(model: ModelConfig, key: str) -> object:
    """``model``'s effective value of a ``[model]`` setting: unset kv heads are all heads, an unset MLP
    width is mlp_ratio x hidden, an unset head dim hidden / heads, unset q/k/v biases follow bias, an
    unset expert width is the MLP width / top_k, an unset shared expert width the experts'."""
    if key == "moe.shared_ffn_hidden":
        moe = getattr(model, "moe")  # noqa: B009  (a family with experts)
        return moe.shared_ffn_hidden or getattr(model, "expert_width")  # noqa: B009
    value: object = model
    for part in _EFFECTIVE.get(key, key).split("."):  # "moe.top_k": a nested table's field
        value = getattr(value, part)
    return value


def shape_differences(model: Any, shape: Mapping[str, object]) -> dict[str, object]:
    """The entries of ``shape`` (setting -> required value) that ``model`` does not have (an unset
    qkv_bias follows bias: only bias is named then)."""
    follows = "qkv_bias" in shape and model.qkv_bias is None and shape["qkv_bias"] == shape.get("bias")
    return {
        key: value
        for key, value in shape.items()
        if setting(model, key) != value and not (key == "qkv_bias" and follows and "bias" in shape)
    }


# -- typed reads of config.json (untrusted: every value checked before use) ----------------------------
_MISSING = object()


def read_int(hf: Mapping[str, Any], key: str, where: str, *, default: Any = _MISSING, low: int = 1) -> int:
    """An integer >= ``low``; ``default`` when the key is absent or null (required without one)."""
    value = _get(hf, key, where, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise CheckpointError(f"{where}: {key}={value!r} must be an integer >= {low}")
    return value


def read_number(
    hf: Mapping[str, Any], key: str, where: str, *, default: Any = _MISSING, above: float, below: float = math.inf
) -> float:
    """A finite number strictly between ``above`` and ``below``."""
    value = _get(hf, key, where, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not above < value < below:
        bounds = f"> {above}" if below == math.inf else f"in ({above}, {below})"
        raise CheckpointError(f"{where}: {key}={value!r} must be a finite number {bounds}")
    return float(value)


def read_bool(hf: Mapping[str, Any], key: str, where: str, *, default: bool) -> bool:
    value = _get(hf, key, where, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key}={value!r} must be true or false")
    return value


def require(hf: Mapping[str, Any], key: str, where: str, fine: tuple[object, ...], why: str) -> None:
    """``key`` absent, null, or one of ``fine`` (compared with its JSON type: true is not 1)."""
    value = hf.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        value = int(value)  # an int that remembers its key (polyshard.models.hf_keys) is an int
    if value is not None and not any(type(value) is type(ok) and value == ok for ok in fine):
        raise CheckpointError(f"{where}: {key}={value!r} is not supported ({why}); polyshard reads {fine[0]!r}")


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "mscale",
             "mscale_all_dim", "attention_factor")  # fmt: skip
"""The keys of transformers' ``rope_parameters`` for ``rope_type = "yarn"`` (besides rope_type and rope_theta)."""


def read_yarn(params: Mapping[str, Any], where: str) -> dict[str, object]:
    """YaRN's ``rope_parameters`` as ``[model.rope]`` settings (gpt-oss, DeepSeek-V2/V3). An mscale of 0 is
    read as unset, as transformers reads it (a falsy mscale falls back to 0.1 ln(factor) + 1)."""
    factor = read_number(params, "factor", where, above=0.0)
    if factor < 1.0:
        raise CheckpointError(f"{where}: factor={factor} must be >= 1 (YaRN stretches the context)")
    optional = {
        key: read_number(params, key, where, above=0.0) if params.get(key) not in (None, 0, 0.0) else None
        for key in ("mscale", "mscale_all_dim", "attention_factor")
    }
    return {
        "rope.scaling": "yarn",
        "rope.factor": factor,
        "rope.original_context": read_int(params, "original_max_position_embeddings", where),
        "rope.beta_fast": read_number(params, "beta_fast", where, default=32.0, above=0.0),
        "rope.beta_slow": read_number(params, "beta_slow", where, default=1.0, above=0.0),
        "rope.truncate": read_bool(params, "truncate", where, default=True),
        **{f"rope.{key}": value for key, value in optional.items()},
    }


def yarn_parameters(rope: RopeConfig) -> dict[str, object]:
    """``[model.rope]`` as transformers' ``rope_parameters``: YaRN's when it stretches (unset mscales left
    out), else the default rule's."""
    if not rope.stretched:
        return {"rope_type": "default", "rope_theta": rope.theta}
    out: dict[str, object] = {
        "rope_type": "yarn", "rope_theta": rope.theta, "factor": rope.factor, "beta_fast": rope.beta_fast,
        "beta_slow": rope.beta_slow, "truncate": rope.truncate,
        "original_max_position_embeddings": rope.original_context,
    }  # fmt: skip
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(rope, key) is not None:
            out[key] = getattr(rope, key)
    return out


def _get(hf: Mapping[str, Any], key: str, where: str, default: Any) -> Any:
    value = hf.get(key)
    if value is None:
        if default is _MISSING:
            raise CheckpointError(f"{where}: {key} is missing; a Hugging Face config.json names it")
        return default
    return value
