"""Exports that need the run's settings: the plain model's weights (tied names included) and a
Hugging Face folder. Both stream from the checkpoint, one tensor at a time."""

from __future__ import annotations

from pathlib import Path

import torch

from polyshard.checkpoint import Checkpoint
from polyshard.checkpoint import consolidate as consolidate_weights
from polyshard.checkpoint import export as export_weights
from polyshard.models import export_metadata, tied_names
from polyshard.trainer.checkpointing.base_and_adapters import base_weights
from polyshard.trainer.checkpointing.saved import check_saved_shapes as check_saved_shapes
from polyshard.trainer.checkpointing.saved import saved_config as saved_config


def _aliases(source: Checkpoint) -> dict[str, str]:
    return tied_names(saved_config(source).model) if "config" in source.index else {}


def _recorded(source: Checkpoint) -> dict[str, str]:
    """The model's settings, recorded in the export so that :func:`polyshard.models.load` rebuilds it."""
    return export_metadata(saved_config(source).model) if "config" in source.index else {}


def consolidate(source: str | Path | Checkpoint) -> dict[str, torch.Tensor]:
    """The unsharded weights the plain model loads with ``load_state_dict(strict=True)`` (a LoRA checkpoint of
    adapters only: with its recorded base, checked against the recorded checksum as it is read)."""
    source = source if isinstance(source, Checkpoint) else Checkpoint(source)
    check_saved_shapes(source)  # the model built from the saved config must take these weights
    return {**base_weights(source), **consolidate_weights(source, _aliases(source))}


def export(source: str | Path | Checkpoint, destination: str | Path, *, overwrite: bool = False) -> Path:
    """One safetensors file of the plain model's weights (streamed; see :func:`polyshard.checkpoint.export`:
    an existing file is replaced only with ``overwrite``, a file of the checkpoint never)."""
    source = source if isinstance(source, Checkpoint) else Checkpoint(source)
    check_saved_shapes(source)  # the settings recorded in the file must describe its weights
    return export_weights(source, destination, _aliases(source), overwrite=overwrite, metadata=_recorded(source))
