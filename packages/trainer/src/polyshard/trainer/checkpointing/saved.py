"""A checkpoint's own settings, read back: the config of the run that saved it, and the check that its
tensors have the shapes that config gives them. Everything that reads a checkpoint with its settings
(exports, resharding, a LoRA checkpoint's base) starts here."""

from __future__ import annotations

from polyshard.checkpoint import MODEL, Checkpoint, CheckpointError
from polyshard.models import build_model
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
