"""Exports that need the run's settings: the plain model's weights (tied names included) and a
Hugging Face folder. Both stream from the checkpoint, one tensor at a time."""

from __future__ import annotations

from pathlib import Path

import torch

from polyshard.checkpoint import MODEL, Checkpoint, CheckpointError
from polyshard.checkpoint import consolidate as consolidate_weights
from polyshard.checkpoint import export as export_weights
from polyshard.models import build_model, export_metadata, tied_names
from polyshard.trainer.config import Config, from_dict
from polyshard.trainer.errors import ConfigError

# Settings older checkpoints record that no longer exist: the launcher now resolves the layout
# (`--layout auto`) and hands the planner's prediction to the run in a file of its own.
RETIRED = {"parallel": ("layout",), "logging": ("predicted_step_s",)}


def saved_config(source: Checkpoint) -> Config:
    """The settings of the run that saved ``source``, parsed and checked like a config file (the
    :data:`RETIRED` ones an older checkpoint records are passed over)."""
    settings = {
        section: {k: v for k, v in values.items() if k not in RETIRED.get(section, ())}
        if isinstance(values, dict)
        else values
        for section, values in source.settings.items()
    }
    try:
        return from_dict(settings, saved=True)
    except ConfigError as err:
        raise CheckpointError(f"{source.folder}/index.json: the saved config is not valid: {err}") from err


def check_saved_shapes(source: Checkpoint) -> None:
    """Each model tensor ``source`` holds has the shape its saved config gives it (the model built on the
    meta device: nothing allocated). An index whose config was edited (4 experts made 16) is named here,
    before any file is written, rather than midway through writing one."""
    if "config" not in source.index:
        return
    expected = {n: tuple(t.shape) for n, t in build_model(saved_config(source).model, layers=()).state_dict().items()}
    for name, saved in source.params().items():
        if name in expected and tuple(saved) != expected[name]:
            raise CheckpointError(
                f"{source.folder}/index.json: the saved config makes {MODEL + name!r} {list(expected[name])}, but "
                f"the checkpoint holds it as {list(saved)}; the index was edited or does not belong to these files"
            )


def _aliases(source: Checkpoint) -> dict[str, str]:
    return tied_names(saved_config(source).model) if "config" in source.index else {}


def _recorded(source: Checkpoint) -> dict[str, str]:
    """The model's settings, recorded in the export so that :func:`polyshard.models.load` rebuilds it."""
    return export_metadata(saved_config(source).model) if "config" in source.index else {}


def consolidate(source: str | Path | Checkpoint) -> dict[str, torch.Tensor]:
    """The unsharded weights the plain model loads with ``load_state_dict(strict=True)`` (a LoRA checkpoint of
    adapters only: with its recorded base, checked against the recorded checksum as it is read)."""
    # That module reads checkpoints through this one's saved_config: imported when needed, not at the top.
    from polyshard.trainer.checkpointing.base_and_adapters import base_weights

    source = source if isinstance(source, Checkpoint) else Checkpoint(source)
    check_saved_shapes(source)  # the model built from the saved config must take these weights
    return {**base_weights(source), **consolidate_weights(source, _aliases(source))}


def export(source: str | Path | Checkpoint, destination: str | Path, *, overwrite: bool = False) -> Path:
    """One safetensors file of the plain model's weights (streamed; see :func:`polyshard.checkpoint.export`:
    an existing file is replaced only with ``overwrite``, a file of the checkpoint never)."""
    source = source if isinstance(source, Checkpoint) else Checkpoint(source)
    check_saved_shapes(source)  # the settings recorded in the file must describe its weights
    return export_weights(source, destination, _aliases(source), overwrite=overwrite, metadata=_recorded(source))
