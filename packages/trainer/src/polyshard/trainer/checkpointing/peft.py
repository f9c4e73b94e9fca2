"""LoRA adapters as PEFT folders: ``adapter_config.json`` + ``adapter_model.safetensors``, the files
``peft.PeftModel.from_pretrained`` loads onto the ``transformers`` base model and the Hub shares.

Keys are PEFT's: ``base_model.model.<the Hugging Face module path>.lora_A.weight`` (A, (r, in)) and
``….lora_B.weight`` (B, (out, r)), the module paths those of the family's files
(:mod:`polyshard.models.lora_targets`). A folder we read is untrusted: its JSON through
:func:`polyshard.checkpoint.untrusted.read_json`, every name, shape and value checked against the run's
model and ``[lora]`` before a tensor is used, each refusal one line naming the file (the reading side,
and the names both sides use, are :mod:`polyshard.trainer.engine.peft_folder`'s: the engine starts from them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from polyshard.checkpoint import MODEL, Checkpoint, CheckpointError
from polyshard.checkpoint.hf import check_new_folder
from polyshard.checkpoint.output import new_folder, reading
from polyshard.models.common.lora import lora_scale
from polyshard.models.hf_families import family_of
from polyshard.models.lora_targets import Target, select_targets
from polyshard.trainer.checkpointing.base_and_adapters import recorded_folder
from polyshard.trainer.checkpointing.run_export import check_saved_shapes, consolidate, saved_config
from polyshard.trainer.config import Config
from polyshard.trainer.config.lora import LoRAConfig
from polyshard.trainer.engine.peft_folder import CONFIG_FILE, WEIGHTS_FILE, peft_keys, peft_targets


def target_modules(config: Config, targets: list[Target]) -> list[str]:
    """PEFT's ``target_modules``: a short name (``q_proj``) where it matches exactly the adapted modules
    (PEFT matches a name against each module path's end), else the adapted modules' whole paths (a
    routed expert's ``gate_proj`` beside an adapted shared expert's)."""
    every = {
        name.removesuffix(".weight")
        for location in family_of(config.model).locations(config.model).values()
        for name in (location.stacked or (location.name,))
    }
    adapted = {t.hf_path for t in targets}
    out: set[str] = set()
    for short in {t.short for t in targets}:
        others = {m for m in every - adapted if m.rsplit(".", 1)[-1] == short}
        out |= {t.hf_path for t in targets if t.short == short and t.hf_path} if others else {short}
    return sorted(out)


def adapter_config(lora: LoRAConfig, modules: list[str], base: Path | None = None) -> dict[str, object]:
    """``adapter_config.json``: PEFT's LoraConfig of these adapters (inference mode, as PEFT saves it);
    ``base``: the Hugging Face folder they were trained on, which ``peft.AutoPeftModelForCausalLM`` loads."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.rslora,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
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
    destination = check_new_folder(destination, overwrite=overwrite, protected=reading(source.folder))
    check_saved_shapes(source)
    tensors = {}
    for target in targets:
        for part, key in zip(("lora_A", "lora_B"), peft_keys(target), strict=True):
            tensors[key] = source.whole(f"{MODEL}{target.name}.{part}.weight").contiguous()
    assert config.lora is not None  # _targets refused a run without adapters
    with new_folder(destination, overwrite=overwrite) as tmp:
        settings = adapter_config(config.lora, target_modules(config, targets), recorded_folder(source))
        (tmp / CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    return destination


def merged_weights(source: Checkpoint) -> dict[str, torch.Tensor]:
    """``source``'s unsharded weights with each adapter folded into its linear, W + scale B A (computed in
    float32, stored in W's dtype): the plain model's weights, for ``--format hf --merge``."""
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
    return state
