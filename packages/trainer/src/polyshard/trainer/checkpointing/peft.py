"""LoRA adapters as PEFT folders: ``adapter_config.json`` + ``adapter_model.safetensors``, the files
``peft.PeftModel.from_pretrained`` loads onto the ``transformers`` base model and the Hub shares.

Keys are PEFT's: ``base_model.model.<the Hugging Face module path>.lora_A.weight`` (A, (r, in)) and
``….lora_B.weight`` (B, (out, r)), the module paths those of the family's files
(:mod:`polyshard.models.lora_targets`). A folder we read is untrusted: its JSON through
:func:`polyshard.checkpoint.untrusted.read_json`, every name, shape and value checked against the run's
model and ``[lora]`` before a tensor is used, each refusal one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from polyshard.checkpoint import MODEL, Checkpoint, CheckpointError
from polyshard.checkpoint.hf import check_new_folder
from polyshard.checkpoint.output import new_folder, reading
from polyshard.checkpoint.untrusted import check_inside, read_json
from polyshard.models.common.lora import lora_scale
from polyshard.models.hf_families import family_of
from polyshard.models.lora_targets import Target, select_targets
from polyshard.trainer.checkpointing.run_export import check_saved_shapes, consolidate, saved_config
from polyshard.trainer.config import Config
from polyshard.trainer.config.lora import PEFT_PREFIX, LoRAConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_keys(target: Target) -> tuple[str, str]:
    """PEFT's names of ``target``'s A and B."""
    return f"{PREFIX}{target.hf_path}.lora_A.weight", f"{PREFIX}{target.hf_path}.lora_B.weight"


def _targets(config: Config, where: str) -> list[Target]:
    lora = config.lora
    if lora is None:
        raise CheckpointError(f"{where} trained no LoRA adapters ([lora] was not set); --format hf writes its model")
    family_of(config.model)  # a model of a Hugging Face family, or an error naming what it would need
    targets = select_targets(config.model, lora.target_list, lora.rank)
    fused = sorted({t.short for t in targets if t.hf_path is None})
    if fused:
        raise CheckpointError(
            f"{where}: the adapters on {fused} are parts of one fused Hugging Face tensor, which a PEFT file cannot "
            "hold one by one; train with lora.targets naming the family's own modules"
        )
    return targets


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


def adapter_config(lora: LoRAConfig, modules: list[str]) -> dict[str, object]:
    """``adapter_config.json``: PEFT's LoraConfig of these adapters (inference mode, as PEFT saves it)."""
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
        "base_model_name_or_path": None,
    }


def write_peft(source: Checkpoint, destination: str | Path, *, overwrite: bool = False) -> Path:
    """A PEFT folder of ``source``'s adapters in ``destination`` (new, or replaced with ``overwrite``);
    built under a temporary name and renamed, so it is whole or absent."""
    config = saved_config(source)
    targets = _targets(config, str(source.folder))
    destination = check_new_folder(destination, overwrite=overwrite, protected=reading(source.folder))
    check_saved_shapes(source)
    tensors = {}
    for target in targets:
        for part, key in zip(("lora_A", "lora_B"), peft_keys(target), strict=True):
            tensors[key] = source.whole(f"{MODEL}{target.name}.{part}.weight").contiguous()
    assert config.lora is not None  # _targets refused a run without adapters
    with new_folder(destination, overwrite=overwrite) as tmp:
        settings = adapter_config(config.lora, target_modules(config, targets))
        (tmp / CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    return destination


def peft_folder(init: str | None) -> Path | None:
    """The folder of ``lora.init = "peft:DIR"`` (None: PEFT's initialisation)."""
    return None if init is None else Path(init.removeprefix(PEFT_PREFIX))


def read_peft(config: Config) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapters of ``config.lora.init``'s PEFT folder by our linear's name (whole A and B), checked
    against the run: a LoRA adapter of the same rank, alpha and rslora, on exactly the run's targets with
    the model's shapes, finite values; empty without ``lora.init``."""
    lora = config.lora
    folder = None if lora is None else peft_folder(lora.init)
    if lora is None or folder is None:
        return {}
    where = f"lora.init: {folder}"
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"{where} holds no {CONFIG_FILE} and {WEIGHTS_FILE}; give a PEFT adapter folder")
    settings = read_json(folder, folder / CONFIG_FILE)
    kind = settings.get("peft_type") if isinstance(settings, dict) else None
    if kind != "LORA":
        raise CheckpointError(f"{where}/{CONFIG_FILE}: peft_type={kind!r} is not read; polyshard reads 'LORA' adapters")
    ours = {"r": lora.rank, "lora_alpha": lora.alpha, "use_rslora": lora.rslora}
    for key, value in ours.items():
        if settings.get(key, False if key == "use_rslora" else None) != value:
            raise CheckpointError(
                f"{where}/{CONFIG_FILE}: {key}={settings.get(key)!r} but [lora] says {value!r}; set lora's "
                f"{'rank' if key == 'r' else key.removeprefix('lora_').removeprefix('use_')} to match the folder"
            )
    if settings.get("fan_in_fan_out") or settings.get("use_dora") or settings.get("bias", "none") != "none":
        raise CheckpointError(f"{where}/{CONFIG_FILE}: fan_in_fan_out, DoRA and trained biases are not read")
    targets = _targets(config, where)
    expected = {key: target for target in targets for key in peft_keys(target)}
    path = folder / WEIGHTS_FILE
    check_inside(folder, path)
    out: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if names != set(expected):
                extra, missing = sorted(names - set(expected)), sorted(set(expected) - names)
                raise CheckpointError(
                    f"{path}: its adapters are not this model's [lora] targets (unexpected {extra[:3]}, missing "
                    f"{missing[:3]}); was it made for another base or other lora.targets?"
                )
            for key in sorted(names):
                target, tensor = expected[key], f.get_tensor(key)
                part = "A" if key.endswith(".lora_A.weight") else "B"
                shape = (lora.rank, target.in_features) if part == "A" else (target.out_features, lora.rank)
                if tuple(tensor.shape) != shape or not tensor.is_floating_point():
                    raise CheckpointError(
                        f"{path}: {key} is {tensor.dtype} {tuple(tensor.shape)}, this model needs a float {shape}; "
                        "the adapter was made for another base"
                    )
                if not torch.isfinite(tensor).all():
                    raise CheckpointError(f"{path}: {key} holds NaN or infinite values")
                out.setdefault(target.name, {})[part] = tensor.float()
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from err
    return {name: (pair["A"], pair["B"]) for name, pair in out.items()}


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
