"""Load a model that ``polyshard export RUN FILE`` wrote: built from the settings the file records, its
weights loaded with ``load_state_dict(strict=True)``.

The export holds the plain model's weights (every name the unsharded model has; a tied weight under
each of its names) and, in the safetensors header's metadata under :data:`SETTINGS_KEY`, the model's
settings: the run's ``[model]`` with every field resolved, as :func:`export_metadata` writes them. So
the file alone rebuilds the model, whatever its family::

    from polyshard.models import load

    model = load("model.safetensors")  # or the folder holding model.safetensors

A file without those settings (exported before they were recorded) loads with ``model=`` the run's
``[model]`` settings (``config.json``'s ``"model"`` in the run folder), or a :class:`ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from polyshard.checkpoint import CheckpointError
from polyshard.models.build import build_model, check_model
from polyshard.models.config import ModelConfig
from polyshard.models.settings import model_config

SETTINGS_KEY = "polyshard.model"
"""The metadata key of an export's model settings (a JSON object)."""
WEIGHTS = "model.safetensors"
"""The file :func:`load` looks for in a folder."""


def export_metadata(config: ModelConfig) -> dict[str, str]:
    """What an export records of ``config`` in its header, for :func:`load` to rebuild the model."""
    return {SETTINGS_KEY: json.dumps(dataclasses.asdict(config), sort_keys=True)}


def load(
    path: str | Path, *, model: ModelConfig | Mapping[str, Any] | None = None, device: torch.device | str = "cpu"
) -> nn.Module:
    """The model exported to ``path`` (a ``.safetensors`` file, or a folder holding :data:`WEIGHTS`), on
    ``device`` and in eval mode. ``model``: its settings, for a file that records none. The file's
    names and shapes are checked against the model before any weight is allocated."""
    file = _weights_file(Path(path).expanduser())
    metadata, shapes = _header(file)
    config = _settings(file, metadata, model)
    _check_tensors(file, config, shapes)
    built = build_model(config, device=device)
    built.load_state_dict(load_file(file, device=str(device)), strict=True)
    return built.eval()


def _weights_file(path: Path) -> Path:
    if path.is_dir():
        if (path / WEIGHTS).is_file():
            return path / WEIGHTS
        hint = " (a --format hf folder: load it with transformers)" if (path / "config.json").is_file() else ""
        raise CheckpointError(f"{path} holds no {WEIGHTS}{hint}; give the file `polyshard export RUN FILE` wrote")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file or folder; give the file `polyshard export RUN FILE` wrote")
    return path


def _header(file: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """The file's metadata and every tensor's shape, read from its header alone."""
    try:
        with safe_open(str(file), "pt", device="cpu") as handle:
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
            return dict(handle.metadata() or {}), shapes
    except (SafetensorError, OSError) as err:
        raise CheckpointError(
            f"{file}: not a safetensors file ({err}); give the file `polyshard export` wrote"
        ) from err


def _settings(file: Path, metadata: Mapping[str, str], given: ModelConfig | Mapping[str, Any] | None) -> ModelConfig:
    if isinstance(given, ModelConfig):
        return given
    if given is not None:
        values, where = dict(given), "model="
    elif SETTINGS_KEY in metadata:
        where = f"{file}'s recorded model settings"
        try:
            values = json.loads(metadata[SETTINGS_KEY])
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{where} are not JSON ({err}); export the run again") from err
        if not isinstance(values, dict):
            raise CheckpointError(f"{where} are not a JSON object; export the run again")
    else:
        raise CheckpointError(
            f"{file} records no model settings (it was exported before polyshard recorded them, or not by "
            f"`polyshard export`); export the run again, or pass model= the run's [model] settings "
            '(the "model" of its config.json)'
        )
    try:
        config = model_config(values, saved=True)
        check_model(config)  # the checks over the family's parts, as a run's settings get
        return config
    except ValueError as err:  # a ConfigError, or a part's own check (MoEConfigError)
        raise CheckpointError(f"{where}: {err}") from err


def _check_tensors(file: Path, config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The file holds exactly the tensors of the model ``config`` describes (built on the meta device:
    nothing allocated), so a mismatch is named before a large model is built."""
    expected = {name: tuple(t.shape) for name, t in build_model(config, layers=()).state_dict().items()}
    missing = sorted(expected.keys() - shapes.keys())
    extra = sorted(shapes.keys() - expected.keys())
    both = sorted(expected.keys() & shapes.keys())
    wrong = [f"{n} {list(shapes[n])} (the model's {list(expected[n])})" for n in both if shapes[n] != expected[n]]
    problems = [
        f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
        for what, names in (("missing", missing), ("not in the model", extra), ("of another shape", wrong))
        if names
    ]
    if problems:
        raise CheckpointError(
            f"{file} does not hold the weights of the model.kind={config.kind!r} model its settings describe "
            f"({'; '.join(problems)}); give the settings of the run it was exported from"
        )
