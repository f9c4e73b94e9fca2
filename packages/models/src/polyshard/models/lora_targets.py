"""Which linears ``lora.targets`` selects, named as Hugging Face names them (``q_proj``, ``down_proj``,
MLA's ``q_a_proj`` ...), with the Hugging Face module path each one has (PEFT's keys).

The names come from the family's Hugging Face adapter (:class:`polyshard.models.hf_adapter.HFAdapter`'s
``locations``: our parameter -> its tensor in the family's files), so there is one table of names, not
two. A linear whose weight is one part of a fused tensor (GPT-2's ``c_attn`` holds q, k and v) is named
both ways: by our name (``q_proj``, that part alone) and by the fused module's (``c_attn``, every part);
its Hugging Face path is the fused module's, with the part's place in it (PEFT's file holds one adapter
on the whole of ``c_attn``, which the PEFT writer and reader build from and split into the parts'). ``"all-linear"``
selects every linear of the blocks, as PEFT's does (never the output head), but not a mixture of
experts' router, a shared expert's gate (Qwen2-MoE's one-wide ``shared_expert_gate``) or the routed
experts: the shared expert's linears are adapted; the routed experts' stacked weights are no linears,
and ``lora.experts`` adapts them (:mod:`polyshard.models.common.moe.lora`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from polyshard.checkpoint import CheckpointError, TensorLocation
from polyshard.models.build import build_model, spec_of
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.hf_adapters import hf_adapter_of

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Target:
    """One adapted linear: its name in our model, its Hugging Face module path (None: the family's files
    have no such module), the short name ``lora.targets`` matches, and its shape. A part of a fused
    module (GPT-2's q in ``c_attn``) is ``part`` of its ``parts``, whose ``hf_short`` selects them all;
    ``conv1d``: the module stores its weight transposed, as GPT-2's ``Conv1D`` does (PEFT's
    ``fan_in_fan_out``)."""

    name: str
    hf_path: str | None
    short: str
    out_features: int
    in_features: int
    part: int = 0
    parts: int = 1
    conv1d: bool = False

    @property
    def hf_short(self) -> str:
        """The Hugging Face module's own name (``c_attn`` for each of its parts; else ``short``)."""
        return self.short if self.hf_path is None else self.hf_path.rsplit(".", 1)[-1]


def _locations(model: ModelConfig) -> dict[str, TensorLocation]:
    """The family's tensor locations: the family ``model`` is exactly, else the first of its kind's."""
    families = spec_of(model).hf_adapters
    if not families:
        return {}
    try:
        return hf_adapter_of(model).locations(model)
    except CheckpointError:  # not exactly a Hugging Face architecture: its kind's names still apply
        return families[0].locations(model)


def linear_targets(model: ModelConfig) -> list[Target]:
    """Every linear of the model's blocks that LoRA may adapt (the output head and the embedding are not)."""
    skeleton = build_model(model, layers=())  # the meta device: names and shapes only
    last = len(skeleton.layers) - 1  # type: ignore[arg-type]  # a family's layers are an nn.ModuleList
    locations = _locations(model)
    out = []
    for name, module in skeleton.named_modules():
        if not isinstance(module, nn.Linear) or name.startswith((f"layers.{last}.", "layers.0.")):
            continue  # the head (and the prediction depths inside it) and the embedding
        if ".moe." in f".{name}." or name.endswith("_gate"):
            continue  # a router or a shared expert's gate (scores that weigh experts) and the routed experts
        where = locations.get(f"{name}.weight")
        short = name.rsplit(".", 1)[-1]
        if where is None or where.stacked or not where.name.endswith(".weight"):
            out.append(Target(name, None, short, module.out_features, module.in_features))
            continue
        path = where.name.removesuffix(".weight")
        if where.parts == 1:
            short = path.rsplit(".", 1)[-1]
        part = where.offset // module.out_features if where.parts > 1 else 0  # parts side by side, equal widths
        shape = (module.out_features, module.in_features)
        out.append(Target(name, path, short, *shape, part=part, parts=where.parts, conv1d=where.transposed))
    return out


def select_targets(model: ModelConfig, targets: str | Sequence[str], rank: int) -> list[Target]:
    """The linears ``targets`` names (``"all-linear"`` or Hugging Face module names), checked: each name
    matches a linear, and ``rank`` fits every selected one."""
    every = linear_targets(model)
    if isinstance(targets, str):
        targets = [targets]
    names = sorted({t.short for t in every} | {t.hf_short for t in every})
    if ALL_LINEAR in targets:
        chosen = every
    else:
        for wanted in targets:
            if wanted not in names:
                raise ConfigError(
                    f"lora.targets: {wanted!r} matches no linear of this model; its linears are {names} "
                    f"(or {ALL_LINEAR!r})"
                )
        chosen = [t for t in every if t.short in targets or t.hf_short in targets]
    if not chosen:
        raise ConfigError(f"lora.targets={list(targets)!r} selects nothing; this model's linears are {names}")
    smallest = min(chosen, key=lambda t: min(t.in_features, t.out_features))
    if rank > min(smallest.in_features, smallest.out_features):
        raise ConfigError(
            f"lora.rank={rank} is larger than {smallest.short} ({smallest.out_features} x {smallest.in_features}); "
            f"choose rank <= {min(smallest.in_features, smallest.out_features)}"
        )
    return chosen
