"""The ``[lora]`` section: train low-rank adapters beside a frozen model (LoRA, 2106.09685) instead of
every weight. Its names are PEFT's (``r`` is ``rank`` here, ``lora_alpha`` ``alpha``, ``target_modules``
``targets``), so scripts and ``polyshard export --format peft`` map one onto the other. Whether the targets
exist and the rank fits them is checked against the model before launch
(:func:`polyshard.models.lora_targets.select_targets`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from polyshard.models.errors import ConfigError

PEFT_PREFIX = "peft:"


@dataclass(kw_only=True, frozen=True)
class LoRAConfig:
    rank: int = 8
    """The adapters' rank r: A is (r, in), B is (out, r). At most the smaller side of every adapted linear."""
    alpha: float = 8.0
    """The update is scaled by alpha / rank (PEFT's lora_alpha; alpha / sqrt(rank) with rslora)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's lora_dropout), in [0, 1)."""
    targets: list[str] | str = "all-linear"
    """The linears to adapt, by their Hugging Face module names ("q_proj", "k_proj", "v_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj", MLA's "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"), or
    "all-linear": every linear of the blocks (never the output head)."""
    experts: bool = False
    """Adapt the routed experts themselves too (an MoE model's stacked expert weights, which ``targets`` never
    selects: gate/up/down, or fc_in/fc_out): one rank-r adapter per expert and matrix, stacked like the experts
    (A (E, in, r), B (E, r, out)) and split over ep with them, PEFT's initialisation and scale; PEFT's
    ``target_parameters`` on the experts. False: the experts stay frozen, their shared linears adapted."""
    rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(rank) (PEFT's use_rslora)."""
    init: str | None = None
    """None: PEFT's initialisation (A Kaiming-uniform, B zero, so the first step starts from the base model);
    "peft:DIR": start from the PEFT adapter folder DIR (adapter_config.json + adapter_model.safetensors)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"lora.rank={self.rank!r} must be an integer >= 1, e.g. 8")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"lora.alpha={self.alpha!r} must be a number > 0, e.g. 16")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout!r} must be in [0, 1), e.g. 0.05")
        names = [self.targets] if isinstance(self.targets, str) else self.targets
        if not names or any(not name for name in names):
            raise ConfigError(f'lora.targets={self.targets!r} must name modules, e.g. ["q_proj", "v_proj"]')
        if not isinstance(self.experts, bool):
            raise ConfigError(f"lora.experts={self.experts!r} must be true or false")
        if self.init is not None and (not self.init.startswith(PEFT_PREFIX) or self.init == PEFT_PREFIX):
            raise ConfigError(
                f'lora.init={self.init!r} must be "peft:DIR" (a PEFT adapter folder), or unset (PEFT\'s initialisation)'
            )

    @property
    def target_list(self) -> list[str]:
        return [self.targets] if isinstance(self.targets, str) else list(self.targets)
