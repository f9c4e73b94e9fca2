"""LoRA adapters as PEFT folders: ``adapter_config.json`` + ``adapter_model.safetensors``, the files
``peft.PeftModel.from_pretrained`` loads onto the ``transformers`` base model and the Hub shares.

Keys are PEFT's: ``base_model.model.<the Hugging Face module path>.lora_A.weight`` (A, (r, in)) and
``….lora_B.weight`` (B, (out, r)), the module paths those of the family's files
(:mod:`polyshard.models.lora_targets`). A folder we read is untrusted: its JSON through
:func:`polyshard.checkpoint.untrusted.read_json`, every name, shape and value checked against the run's
model and ``[lora]`` before a tensor is used, each refusal one line naming the file (the reading side,
and the names both sides use, are :mod:`polyshard.trainer.engine.peft_folder`'s: the engine starts from them;
a fused module's one adapter, GPT-2's ``c_attn``, is described there).

Some adapters a PEFT file can name but peft cannot load where they belong: peft 0.21 on transformers 5
re-targets, in the families whose routed experts transformers fuses into stacked parameters, every module
named like a v4 expert projection (a dense block's or a shared expert's ``gate_proj`` too) at those
experts (``_convert_peft_config_moe`` in ``peft/utils/transformers_weight_conversion.py``, by transformers'
``_MODEL_TO_CONVERSION_PATTERN``). Those are refused by name rather than written to load wrongly. The
routed experts' own adapters (``lora.experts``) go out as PEFT's ``target_parameters``
(:mod:`.peft_experts`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save_file

from polyshard.checkpoint import MODEL, Checkpoint, CheckpointError
from polyshard.checkpoint.hf import check_new_folder
from polyshard.checkpoint.output import new_folder, reading
from polyshard.models.common.lora import lora_scale
from polyshard.models.common.moe.lora import merge_expert_adapters
from polyshard.models.hf_adapters import hf_adapter_of
from polyshard.models.lora_targets import Target, select_targets
from polyshard.trainer.checkpointing.base_and_adapters import recorded_folder
from polyshard.trainer.checkpointing.peft_experts import expert_patterns, expert_target_parameters, expert_tensors
from polyshard.trainer.checkpointing.run_export import check_saved_shapes, consolidate, saved_config
from polyshard.trainer.config import Config
from polyshard.trainer.config.lora import LoRAConfig
from polyshard.trainer.engine.peft_folder import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    fused_patterns,
    peft_keys,
    peft_modules,
    peft_targets,
)

# model_type -> the module names peft 0.21 re-targets at the fused routed experts (its _MOE_TARGET_MODULE_MAPPING
# of the family's conversion pattern); tests/trainer/test_lora_peft_families.py checks it against the installed peft.
PEFT_EXPERT_NAMES: dict[str, tuple[str, ...]] = {
    "deepseek_v2": ("gate_proj", "up_proj", "down_proj", "gate"),
    "deepseek_v3": ("gate_proj", "up_proj", "down_proj", "gate"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj", "gate"),
    "mixtral": ("w1", "w3", "w2", "gate"),
}


def check_peft_loads(config: Config, targets: list[Target], where: str) -> None:
    """Refuse adapters that peft would load onto a family's routed experts instead of their own module."""
    family = hf_adapter_of(config.model)
    names = PEFT_EXPERT_NAMES.get(family.model_type, ())
    wrong = sorted({t.hf_path for t in targets if t.hf_short in names and t.hf_path})
    if wrong:
        kept = sorted({t.hf_short for t in targets} - set(names)) or "the attention's projections"
        raise CheckpointError(
            f"{where}: peft (0.21, transformers 5) loads a {family.title} adapter on {wrong[0]} onto the fused routed "
            f"experts, every {'/'.join(n for n in names if n != 'gate')} alike ({len(wrong)} such modules); train with "
            f"lora.targets = {kept} for a PEFT folder, or export --format hf --merge"
        )


def target_modules(config: Config, targets: list[Target]) -> list[str]:
    """PEFT's ``target_modules``: a short name (``q_proj``) where it matches exactly the adapted modules
    (PEFT matches a name against each module path's end), else the adapted modules' whole paths (a
    routed expert's ``gate_proj`` beside an adapted shared expert's)."""
    every = {
        name.removesuffix(".weight")
        for location in hf_adapter_of(config.model).locations(config.model).values()
        for name in (location.stacked or (location.name,))
    }
    adapted = {t.hf_path for t in targets}
    out: set[str] = set()
    for short in {t.hf_short for t in targets}:
        others = {m for m in every - adapted if m.rsplit(".", 1)[-1] == short}
        out |= {t.hf_path for t in targets if t.hf_short == short and t.hf_path} if others else {short}
    return sorted(out)


def adapter_config(
    lora: LoRAConfig, targets: list[Target], modules: list[str], base: Path | None = None
) -> dict[str, object]:
    """``adapter_config.json``: PEFT's LoraConfig of these adapters (inference mode, as PEFT saves it);
    ``base``: the Hugging Face folder they were trained on, which ``peft.AutoPeftModelForCausalLM`` loads."""
    ranks, alphas = fused_patterns(lora, targets)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.rslora,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": any(t.conv1d for t in targets),  # GPT-2's Conv1D (PEFT sets it so itself)
        "rank_pattern": ranks,
        "alpha_pattern": alphas,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": None if base is None else str(base),
    }


def write_peft(source: Checkpoint, destination: str | Path, *, overwrite: bool = False) -> Path:
    """A PEFT folder of ``source``'s adapters in ``destination`` (new, or replaced with ``overwrite``);
    built under a temporary name and renamed, so it is whole or absent."""
    config = saved_config(source)
    targets = peft_targets(config, str(source.folder))
    check_peft_loads(config, targets, str(source.folder))
    experts = config.lora is not None and config.lora.experts  # the routed experts' own: peft_experts.py
    parameters = expert_target_parameters(config, str(source.folder)) if experts else []
    destination = check_new_folder(destination, overwrite=overwrite, protected=reading(source.folder))
    check_saved_shapes(source)
    tensors = {}
    for module, group in peft_modules(targets).items():
        a_key, b_key = peft_keys(module)
        # one part: its A and B; a fused module's parts: A stacked, B block diagonal (peft_folder's rule)
        tensors[a_key] = torch.cat([source.whole(f"{MODEL}{t.name}.lora_A.weight") for t in group]).contiguous()
        parts = [source.whole(f"{MODEL}{t.name}.lora_B.weight") for t in group]
        tensors[b_key] = torch.block_diag(*parts)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    assert config.lora is not None  # _targets refused a run without adapters
    with new_folder(destination, overwrite=overwrite) as tmp:
        modules = target_modules(config, targets)
        settings = adapter_config(config.lora, targets, modules, recorded_folder(source))
        if parameters:
            tensors |= expert_tensors(config, source)
            ranks, alphas = expert_patterns(config)
            settings["target_parameters"] = parameters
            settings["rank_pattern"] = {**cast(dict[str, int], settings["rank_pattern"]), **ranks}
            settings["alpha_pattern"] = {**cast(dict[str, float], settings["alpha_pattern"]), **alphas}
        (tmp / CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    return destination


def merged_weights(source: Checkpoint) -> dict[str, torch.Tensor]:
    """``source``'s unsharded weights with each adapter folded into its linear, W + scale B A (computed in
    float32, stored in W's dtype), and the routed experts' into theirs, W + scale A @ B per expert: the
    plain model's weights, for ``--format hf --merge``."""
    config = saved_config(source)
    lora = config.lora
    if lora is None:
        raise CheckpointError(f"--merge: {source.folder} trained no LoRA adapters; export it without --merge")
    state = consolidate(source)
    scale = lora_scale(lora.rank, lora.alpha, lora.rslora)
    for target in select_targets(config.model, lora.target_list, lora.rank):
        a, b = state.pop(f"{target.name}.lora_A.weight"), state.pop(f"{target.name}.lora_B.weight")
        weight = state[f"{target.name}.weight"]
        state[f"{target.name}.weight"] = (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
    if lora.experts:
        merge_expert_adapters(state, scale)
    return state
