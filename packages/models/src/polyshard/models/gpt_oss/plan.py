"""How gpt-oss splits: as the MoE GPT (:mod:`polyshard.models.moe_gpt.plan`): heads and their sinks and
the vocabulary over tp, the experts and their biases over ep; the same layouts it cannot run."""

from __future__ import annotations

from polyshard.models.moe_gpt.plan import check, tp_plan

__all__ = ["check", "tp_plan"]
