"""Training configuration: the sections (:mod:`.sections`) and reading them from TOML and
``--set`` overrides (:mod:`.parse`).

One frozen dataclass per section (``model``, ``parallel``, ``training``, ``optimizer``,
``lr_schedule``, ``eval``, ``data``, ``checkpoint``, ``logging``, and ``lora``, ``dpo``, ``grpo`` when
used); each field is documented by the line under it and checked for its own range where it is declared.
Parsing is strict: an unknown key is an error that names it and suggests the
nearest known one. ``--set section.key=value`` overrides any field. Old spellings are
:mod:`.legacy`'s (``[model]``'s: :mod:`polyshard.models.legacy`).

Rules *between* sections that need no processes (the schedule's floor against the optimizer's rate)
are :mod:`.rules`'; those about the mesh and the processes (mesh size vs processes, heads vs tp, layers
vs pipeline stages, ...) are :func:`polyshard.trainer.engine.constraints.validate`'s, checked before
any process starts.
"""

from polyshard.models.config import ModelConfig
from polyshard.models.gpt.presets import LLAMA
from polyshard.models.settings import presets
from polyshard.trainer.config.parse import apply_overrides, auto_dp, check_type, from_dict, load_config, read_toml
from polyshard.trainer.config.sections import (
    MESH_AXES,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    SECTIONS,
    V_SCHEDULES,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LRScheduleConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)

PRESETS = {name: values for name, (_, values) in presets().items()}
"""Every family's presets by name (``model.preset``)."""

__all__ = [
    "LLAMA",
    "MESH_AXES",
    "RECOMPUTE",
    "PRECISIONS",
    "PRESETS",
    "SCHEDULES",
    "SECTIONS",
    "V_SCHEDULES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "LRScheduleConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainingConfig",
    "apply_overrides",
    "auto_dp",
    "check_type",
    "from_dict",
    "load_config",
    "read_toml",
]
