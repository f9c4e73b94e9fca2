"""Every spelling of ``[model]`` an earlier polyshard wrote, and where each now lives; read by
:mod:`polyshard.models.settings` (a config file's old key with a note, a saved config's quietly).

* 0.2 had one flat ``[model]`` table for every family, and a run folder or checkpoint saved all of its
  fields (:data:`LEGACY_DEFAULTS`); a family passes over those it does not have.
* 0.2's MoE settings were flat ``[model]`` keys; they are ``[model.moe]``'s (:data:`MOE_NAMES`).
* Up to 0.4 the rotary settings were twelve flat ``rope_*`` keys; they are ``[model.rope]``'s
  (:data:`ROPE_NAMES`), and 0.4 saved DeepSeek's config with the grouped attention's fields it refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyshard.models.common.rotary import RopeConfig

# 0.2's one flat [model] section: every field and its default (saved configs hold them all; a family
# passes over those it does not have).
LEGACY_DEFAULTS: dict[str, object] = {
    "vocab_size": 256, "context_length": 64, "num_kv_heads": None, "tie_embeddings": False, "norm": "layer",
    "activation": "gelu", "positions": "learned", "bias": True, "rope_theta": 10000.0, "rope_scale_factor": 1.0,
    "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_context": 8192, "mlp_hidden": None,
    "head_dim": None, "qkv_bias": None, "qk_norm": False, "num_experts": 4, "top_k": 2, "capacity_factor": None,
    "aux_loss_weight": 0.01, "expert_hidden": None, "router_renormalize": True, "shared_experts": 0,
    "shared_expert_hidden": None, "shared_expert_gate": False, "router": "softmax", "router_bias_update_rate": 0.0,
    "router_groups": 1, "router_group_topk": 1, "router_scale": 1.0, "seq_aux_loss_weight": 0.0,
    "router_z_loss_weight": 0.0, "image_size": 8, "patch_size": 2, "channels": 1, "num_classes": 10,
    # 0.4 saved DeepSeek's config with the GPT's attention fields it refused, at their defaults.
    "sliding_window": None, "layer_types": None, "attention_sinks": False,
}  # fmt: skip

# 0.2's flat [model] spellings of the MoE settings -> [model.moe] keys.
MOE_NAMES = {
    "num_experts": "num_experts",
    "top_k": "top_k",
    "expert_hidden": "ffn_hidden",
    "capacity_factor": "capacity_factor",
    "aux_loss_weight": "aux_loss_coef",
    "router_z_loss_weight": "z_loss_coef",
    "seq_aux_loss_weight": "seq_aux_loss_coef",
    "router_renormalize": "renormalize",
    "router": "score",
    "router_groups": "groups",
    "router_group_topk": "group_topk",
    "router_scale": "scale",
    "router_bias_update_rate": "bias_update_rate",
    "shared_experts": "shared_experts",
    "shared_expert_hidden": "shared_ffn_hidden",
    "shared_expert_gate": "shared_gate",
}

# 0.4's flat [model] spellings of the rotary settings -> [model.rope] keys.
ROPE_NAMES = {
    "rope_theta": "theta",
    "rope_type": "scaling",
    "rope_scale_factor": "factor",
    "rope_original_context": "original_context",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_beta_fast": "beta_fast",
    "rope_beta_slow": "beta_slow",
    "rope_truncate": "truncate",
    "rope_mscale": "mscale",
    "rope_mscale_all_dim": "mscale_all_dim",
    "rope_attention_factor": "attention_factor",
}

# Every flat spelling an earlier version read -> (its table, its key there).
LEGACY_KEYS: dict[str, tuple[str, str]] = {
    **{old: ("moe", new) for old, new in MOE_NAMES.items()},
    **{old: ("rope", new) for old, new in ROPE_NAMES.items()},
}


def legacy_rope(rope: dict[str, Any], given: Mapping[str, Any], family: RopeConfig) -> dict[str, Any]:
    """0.4's rotary spellings as ``[model.rope]``: its rope_type (default llama3) only chose the rule when
    rope_scale_factor was above 1, so a rule named without a factor is dropped, and a factor named without
    a rule (here or in ``given``, the new table) takes the family's (``family``: its default table; llama3
    where it has none)."""
    rope = dict(rope)
    factor = rope.get("factor", given.get("factor", 1.0))
    if factor == 1.0:
        rope.pop("scaling", None)
    elif "scaling" not in rope and "scaling" not in given:
        rope["scaling"] = family.scaling if family.scaling != "none" else "llama3"
    return rope
