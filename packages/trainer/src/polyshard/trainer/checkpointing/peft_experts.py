"""The routed experts' adapters (``lora.experts``) in a PEFT folder: PEFT's ``target_parameters``, its LoRA on
a 3-D parameter (``peft.tuners.lora.ParamWrapper``, peft 0.21), on transformers 5's fused experts.

Qwen3-MoE's experts there are two parameters, ``mlp.experts.gate_up_proj`` (E, 2F, H) (gate's rows, then
up's) and ``mlp.experts.down_proj`` (E, H, F), each (E, out, in). PEFT holds one adapter per parameter
over every expert: A ``(E * r, in)`` (expert e's rows e*r ... e*r + r - 1) and B ``(out, r * E)`` (expert
e's column j at j*E + e), its delta per expert ``B_e A_e``. Ours are per matrix, (E, in, r) and (E, r, out)
(:mod:`polyshard.models.common.moe.lora`), so:

* down_proj (our ``w2``): A_e = A2[e]^T (r, F), B_e = B2[e]^T (H, r);
* gate_up_proj (our ``w1`` gate and ``w3`` up): one adapter of rank 2r, as GPT-2's fused ``c_attn`` goes
  out: A_e = [A1[e]^T; A3[e]^T] (2r, H), B_e = blockdiag(B1[e]^T, B3[e]^T) (2F, 2r), with
  ``rank_pattern``/``alpha_pattern`` keeping each part's scale alpha / r.

PEFT nests the wrappers of one module's parameters in the module's parameter order: ``gate_up_proj`` is
wrapped first, so its keys are ``…mlp.experts.base_layer.lora_A.weight`` and down_proj's
``…mlp.experts.lora_A.weight``. Only Qwen3-MoE is written (the family tested against peft); PEFT's
ParamWrapper takes no dropout, so an adapter trained with ``lora.dropout`` > 0 is refused too.

Shapes: E experts, H hidden, F an expert's ffn width, r the rank.
"""

from __future__ import annotations

import math

import torch

from polyshard.checkpoint import MODEL, Checkpoint, CheckpointError
from polyshard.models.hf_adapters import hf_adapter_of
from polyshard.trainer.config import Config
from polyshard.trainer.engine.peft_folder import peft_keys

FUSED = {"qwen3_moe": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
"""Families whose fused experts we write adapters for: their ``target_parameters``, gate/up first."""


def expert_target_parameters(config: Config, where: str) -> list[str]:
    """PEFT's ``target_parameters`` for the run's expert adapters; a one-line refusal where PEFT cannot hold
    them as trained (another family, dropout)."""
    assert config.lora is not None
    family = hf_adapter_of(config.model)
    if family.model_type not in FUSED:
        raise CheckpointError(
            f"{where}: its adapters on the routed experts (lora.experts = true) go out to PEFT for "
            f"{sorted(FUSED)} only, not {family.title}; export --format hf --merge instead"
        )
    if config.lora.dropout > 0:
        raise CheckpointError(
            f"{where}: trained with lora.dropout={config.lora.dropout} on the routed experts, which PEFT's adapter "
            "on fused experts (ParamWrapper) cannot apply; export --format hf --merge, or train with lora.dropout = 0"
        )
    return list(FUSED[family.model_type])


def expert_patterns(config: Config) -> tuple[dict[str, int], dict[str, float]]:
    """``rank_pattern`` and ``alpha_pattern`` of gate_up_proj's one rank-2r adapter (each part's alpha / r)."""
    lora = config.lora
    assert lora is not None
    alpha = lora.alpha * (math.sqrt(2) if lora.rslora else 2)
    return {"gate_up_proj": 2 * lora.rank}, {"gate_up_proj": alpha}


def expert_tensors(config: Config, source: Checkpoint) -> dict[str, torch.Tensor]:
    """Every MoE layer's expert adapters in PEFT's keys and layout (see the module docstring)."""
    locations = hf_adapter_of(config.model).locations(config.model)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(source.params()):
        if not name.endswith(".experts.w1_lora_A"):
            continue
        experts = name.removesuffix(".w1_lora_A")  # layers.<i>.mlp.moe.experts
        stacked = locations[f"{experts}.w1"].stacked  # model.layers.<i-1>.mlp.experts.<e>.gate_proj.weight
        assert stacked is not None
        module = stacked[0].rsplit(".", 3)[0]  # model.layers.<i-1>.mlp.experts

        def whole(factor: str, experts: str = experts) -> torch.Tensor:
            return source.whole(f"{MODEL}{experts}.{factor}").float()

        a1, b1, a3, b3 = whole("w1_lora_A"), whole("w1_lora_B"), whole("w3_lora_A"), whole("w3_lora_B")
        count, rank = a1.shape[0], a1.shape[2]
        a = torch.cat([a1.transpose(1, 2), a3.transpose(1, 2)], dim=1)  # (E, 2r, H)
        b = torch.zeros(count, 2 * b1.shape[2], 2 * rank)  # (E, 2F, 2r): gate's block, then up's
        b[:, : b1.shape[2], :rank], b[:, b1.shape[2] :, rank:] = b1.transpose(1, 2), b3.transpose(1, 2)
        gate_up_a, gate_up_b = peft_keys(f"{module}.base_layer")
        out[gate_up_a], out[gate_up_b] = _flat(a, b)
        down_a, down_b = peft_keys(module)
        out[down_a], out[down_b] = _flat(whole("w2_lora_A").transpose(1, 2), whole("w2_lora_B").transpose(1, 2))
    return out


def _flat(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert A (E, r, in) and B (E, out, r) as PEFT's A (E * r, in) and B (out, r * E)."""
    count, rank, fan_in = a.shape
    return a.reshape(count * rank, fan_in).contiguous(), b.permute(1, 2, 0).reshape(
        b.shape[1], rank * count
    ).contiguous()
