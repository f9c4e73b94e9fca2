"""Training configuration: the sections (:mod:`.sections`) and reading them from TOML and
``--set`` overrides (:mod:`.parse`).

One frozen dataclass per section (``model``, ``parallel``, ``training``, ``data``,
``checkpoint``, ``logging``); each field is documented by the line under it.
Parsing is strict: an unknown key is an error that names it and suggests the
nearest known one. ``--set section.key=value`` overrides any field.

Constraints *between* fields (mesh size vs processes, heads vs tp, layers vs
pipeline stages, ...) are checked by
:func:`polyshard.trainer.engine.constraints.validate` before any process starts.
"""

from polyshard.models.config import ModelConfig
from polyshard.models.gpt.presets import LLAMA
from polyshard.models.settings import presets
from polyshard.trainer.config.parse import apply_overrides, auto_dp, check_type, from_dict, load_config, read_toml
from polyshard.trainer.config.sections import (
    CHECKPOINTING,
    MESH_AXES,
    PRECISIONS,
    SCHEDULES,
    SECTIONS,
    V_SCHEDULES,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ParallelConfig,
    TrainingConfig,
)

PRESETS = {name: values for name, (_, values) in presets().items()}
"""Every family's presets by name (``model.preset``)."""

__all__ = [
    "LLAMA",
    "MESH_AXES",
    "CHECKPOINTING",
    "PRECISIONS",
    "PRESETS",
    "SCHEDULES",
    "SECTIONS",
    "V_SCHEDULES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainingConfig",
    "apply_overrides",
    "auto_dp",
    "check_type",
    "from_dict",
    "load_config",
    "read_toml",
]
