"""A PEFT folder as a run reads it (``lora.init = "peft:DIR"``): its file names, PEFT's key names of each
adapted linear, and the adapters checked against the run's model and ``[lora]`` before the engine is built
(:func:`polyshard.trainer.engine.lora.apply_lora` starts from them). Writing such a folder is the
checkpointing layer's (:mod:`polyshard.trainer.checkpointing.peft`), which names files and keys from here.

A folder we read is untrusted: its JSON through :func:`polyshard.checkpoint.untrusted.read_json`, every
name, shape and value checked before a tensor is used, each refusal one line naming the file.

A fused Hugging Face module (GPT-2's ``c_attn``: q, k and v side by side) holds one PEFT adapter, where
our model has one per part. Ours go out exactly as one adapter of rank parts x r: A the parts' A stacked,
B block diagonal (each part's B on its own rows and columns), with PEFT's ``rank_pattern`` and
``alpha_pattern`` keeping each part's scale alpha / r. Such a folder reads back block by block; a PEFT
adapter of rank r on the whole module (PEFT's own) reads as the same A in every part and B's rows split.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from polyshard.checkpoint import CheckpointError
from polyshard.checkpoint.untrusted import check_inside, read_json
from polyshard.models.hf_adapters import hf_adapter_of
from polyshard.models.lora_targets import Target, select_targets
from polyshard.trainer.config import Config
from polyshard.trainer.config.lora import PEFT_PREFIX, LoRAConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_keys(hf_path: str) -> tuple[str, str]:
    """PEFT's names of the A and B of the adapter on the Hugging Face module ``hf_path``."""
    return f"{PREFIX}{hf_path}.lora_A.weight", f"{PREFIX}{hf_path}.lora_B.weight"


def peft_targets(config: Config, where: str) -> list[Target]:
    """The run's targets, each on a Hugging Face module (a fused module's parts all adapted or none)."""
    lora = config.lora
    if lora is None:
        raise CheckpointError(f"{where} trained no LoRA adapters ([lora] was not set); --format hf writes its model")
    hf_adapter_of(config.model)  # a model of a Hugging Face family, or an error naming what it would need
    targets = select_targets(config.model, lora.target_list, lora.rank)
    for path, group in peft_modules(targets).items():
        if path is None or len(group) != group[0].parts:
            every = sorted({t.short for t in select_targets(config.model, group[0].hf_short, lora.rank)})
            raise CheckpointError(
                f"{where}: the adapters on {sorted({t.short for t in group})} are parts of the fused Hugging Face "
                f"module {group[0].hf_short}, which PEFT adapts as a whole; train with lora.targets naming all of "
                f"{every} (or {group[0].hf_short!r}) or none of them"
            )
    return targets


def peft_modules(targets: list[Target]) -> dict[str, list[Target]]:
    """The adapted Hugging Face modules by path, each with its targets in part order (one, but for the
    parts of a fused module)."""
    out: dict[str, list[Target]] = {}
    for target in targets:
        out.setdefault(target.hf_path, []).append(target)  # type: ignore[arg-type]  # None: refused by the caller
    return {path: sorted(group, key=lambda t: t.part) for path, group in out.items()}


def fused_patterns(lora: LoRAConfig, targets: list[Target]) -> tuple[dict[str, int], dict[str, float]]:
    """PEFT's ``rank_pattern`` and ``alpha_pattern`` of a fused module's one adapter of rank parts x r:
    the alpha that keeps PEFT's scale (alpha / r, or alpha / sqrt(r) with rsLoRA) each part's."""
    parts = {t.hf_short: t.parts for t in targets if t.parts > 1}
    ranks = {short: n * lora.rank for short, n in parts.items()}
    alphas = {short: lora.alpha * (math.sqrt(n) if lora.rslora else n) for short, n in parts.items()}
    return ranks, alphas


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
    if settings.get("use_dora") or settings.get("bias", "none") != "none":
        raise CheckpointError(f"{where}/{CONFIG_FILE}: DoRA and trained biases are not read")
    targets = peft_targets(config, where)
    conv1d = any(t.conv1d for t in targets)  # GPT-2's Conv1D: PEFT sets fan_in_fan_out (A and B as a Linear's)
    if bool(settings.get("fan_in_fan_out", False)) != conv1d:
        raise CheckpointError(
            f"{where}/{CONFIG_FILE}: fan_in_fan_out={settings.get('fan_in_fan_out')!r}, but this model's modules "
            f"{'are' if conv1d else 'are not'} Conv1D (fan_in_fan_out={conv1d}); the adapter was made for another base"
        )
    patterned = _read_patterns(settings, lora, targets, f"{where}/{CONFIG_FILE}")
    modules = peft_modules(targets)
    expected = {key: path for path in modules for key in peft_keys(path)}
    path = folder / WEIGHTS_FILE
    check_inside(folder, path)
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if names != set(expected):
                extra, missing = sorted(names - set(expected)), sorted(set(expected) - names)
                raise CheckpointError(
                    f"{path}: its adapters are not this model's [lora] targets (unexpected {extra[:3]}, missing "
                    f"{missing[:3]}); was it made for another base or other lora.targets?"
                )
            out = {}
            for module, group in modules.items():
                a_key, b_key = peft_keys(module)
                rank = lora.rank * (len(group) if patterned and len(group) > 1 else 1)
                a = _checked(path, a_key, f.get_tensor(a_key), (rank, group[0].in_features))
                b = _checked(path, b_key, f.get_tensor(b_key), (sum(t.out_features for t in group), rank))
                out.update(_split(path, b_key, group, a, b, lora.rank if rank > lora.rank else 0))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from err
    return out


def _read_patterns(settings: dict[str, Any], lora: LoRAConfig, targets: list[Target], where: str) -> bool:
    """Whether the folder's fused modules hold our adapters of rank parts x r (its ``rank_pattern`` and
    ``alpha_pattern`` :func:`fused_patterns`'), not PEFT's own of rank r (none); any other pattern is refused."""
    ranks, alphas = fused_patterns(lora, targets)
    found = settings.get("rank_pattern") or {}, settings.get("alpha_pattern") or {}
    if found == ({}, {}):
        return False
    alpha = found[1]
    if ranks and found[0] == ranks and isinstance(alpha, dict) and alpha.keys() == alphas.keys():
        numbers = all(isinstance(alpha[k], (int, float)) for k in alphas)
        if numbers and all(math.isclose(alpha[k], alphas[k], rel_tol=1e-9) for k in alphas):
            return True
    raise CheckpointError(
        f"{where}: rank_pattern={found[0]!r} and alpha_pattern={found[1]!r} are not read; polyshard reads one rank "
        f"and alpha for every module{f' (and {ranks} with {alphas} on fused modules)' if ranks else ''}"
    )


def _checked(path: Path, key: str, tensor: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    if tuple(tensor.shape) != shape or not tensor.is_floating_point():
        raise CheckpointError(
            f"{path}: {key} is {tensor.dtype} {tuple(tensor.shape)}, this model needs a float {shape}; "
            "the adapter was made for another base"
        )
    if not torch.isfinite(tensor).all():
        raise CheckpointError(f"{path}: {key} holds NaN or infinite values")
    return tensor.float()


def _split(
    path: Path, key: str, group: list[Target], a: torch.Tensor, b: torch.Tensor, block: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each part's (A, B) of one module's adapter: B's rows by part; with ``block`` (the rank of each
    part's block, 0: one shared A), A's rows too, B then block diagonal (anything off its blocks refused)."""
    out, row = {}, 0
    for i, target in enumerate(group):
        rows = slice(row, row + target.out_features)
        row += target.out_features
        if not block:
            out[target.name] = (a.clone(), b[rows])
            continue
        columns = slice(i * block, (i + 1) * block)
        outside = b[rows].clone()
        outside[:, columns] = 0
        if outside.any():
            raise CheckpointError(
                f"{path}: {key} is not block diagonal (one rank-{block} block per part of {target.hf_short}), so it "
                "is not polyshard's adapters of its parts; give a rank-r adapter on the whole module"
            )
        out[target.name] = (a[columns], b[rows, columns])
    return out
