"""A PEFT folder as a run reads it (``lora.init = "peft:DIR"``): its file names, PEFT's key names of each
adapted linear, and the adapters checked against the run's model and ``[lora]`` before the engine is built
(:func:`polyshard.trainer.engine.lora.apply_lora` starts from them). Writing such a folder is the
checkpointing layer's (:mod:`polyshard.trainer.checkpointing.peft`), which names files and keys from here.

A folder we read is untrusted: its JSON through :func:`polyshard.checkpoint.untrusted.read_json`, every
name, shape and value checked before a tensor is used, each refusal one line naming the file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from polyshard.checkpoint import CheckpointError
from polyshard.checkpoint.untrusted import check_inside, read_json
from polyshard.models.hf_families import family_of
from polyshard.models.lora_targets import Target, select_targets
from polyshard.trainer.config import Config
from polyshard.trainer.config.lora import PEFT_PREFIX

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_keys(target: Target) -> tuple[str, str]:
    """PEFT's names of ``target``'s A and B."""
    return f"{PREFIX}{target.hf_path}.lora_A.weight", f"{PREFIX}{target.hf_path}.lora_B.weight"


def peft_targets(config: Config, where: str) -> list[Target]:
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
    targets = peft_targets(config, where)
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
