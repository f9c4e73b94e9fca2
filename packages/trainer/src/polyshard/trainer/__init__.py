"""polyshard.trainer: config, models, data, the engine and the training loop.

The front door. What a launcher, a notebook or the ``polyshard`` command needs is importable from
here (each name loads its module on first use, so ``import polyshard.trainer`` costs nothing):

    from polyshard.trainer import read_settings, prepare_launch, train, load_config

The parts, one folder each: ``config`` (the settings and their checks), ``data`` (what each task
reads: text, preference pairs, prompts), ``tasks`` (a batch's inputs, targets and loss: next token,
images, DPO, GRPO and its rewards), ``engine`` (parallelize, context, experts, LoRA, optimizer),
``loop`` (a run: step, evaluate, save, generate, the plan check), ``checkpointing`` (what an engine
saves, how it moves between layouts, exports), ``evaluation`` (lm-evaluation-harness on a
checkpoint), ``runtime`` (launch checks, the worker, heartbeats, lifetime). The model families are
``polyshard.models``'.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Config": "polyshard.trainer.config",
    "MESH_AXES": "polyshard.trainer.config",
    "apply_overrides": "polyshard.trainer.config",
    "from_dict": "polyshard.trainer.config",
    "load_config": "polyshard.trainer.config",
    "ConfigError": "polyshard.trainer.errors",
    "DataError": "polyshard.trainer.errors",
    "NonFiniteError": "polyshard.trainer.errors",
    "CheckpointError": "polyshard.checkpoint",
    "validate": "polyshard.trainer.engine.constraints",
    "Launch": "polyshard.trainer.runtime.launch",
    "prepare_launch": "polyshard.trainer.runtime.launch",
    "read_settings": "polyshard.trainer.runtime.launch",
    "train": "polyshard.trainer.loop",
    "PlannedStep": "polyshard.trainer.loop.plan_check",
    "sample_text": "polyshard.trainer.loop",
    "build_model": "polyshard.models",
    "spec_of": "polyshard.models",
    "hf_adapters": "polyshard.models.hf_adapters",
    "saved_config": "polyshard.trainer.checkpointing.run_export",
    "consolidate": "polyshard.trainer.checkpointing.run_export",
    "export": "polyshard.trainer.checkpointing.run_export",
    "reshard": "polyshard.trainer.checkpointing.run_reshard",
    "target_config": "polyshard.trainer.checkpointing.run_reshard",
    "write_hf": "polyshard.trainer.checkpointing.hugging_face",
    "export_note": "polyshard.trainer.checkpointing.hugging_face",
    "load_tokenizer": "polyshard.data.tokenizer",
    "SCHEDULES": "polyshard.trainer.config",
    "PRESETS": "polyshard.trainer.config",
    "sequence_length": "polyshard.models",
    "model_settings": "polyshard.trainer.checkpointing.hugging_face",
    "train_bpe": "polyshard.data.tokenizer",
    "local_files": "polyshard.trainer.data.language",
    "die_with_parent": "polyshard.trainer.runtime.lifetime",
}

__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "DataError",
    "Launch",
    "MESH_AXES",
    "NonFiniteError",
    "PRESETS",
    "PlannedStep",
    "SCHEDULES",
    "apply_overrides",
    "build_model",
    "consolidate",
    "die_with_parent",
    "export",
    "export_note",
    "from_dict",
    "hf_adapters",
    "load_config",
    "load_tokenizer",
    "local_files",
    "model_settings",
    "prepare_launch",
    "read_settings",
    "reshard",
    "sample_text",
    "saved_config",
    "sequence_length",
    "spec_of",
    "target_config",
    "train",
    "train_bpe",
    "validate",
    "write_hf",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'polyshard.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


if TYPE_CHECKING:
    from polyshard.checkpoint import CheckpointError
    from polyshard.data.tokenizer import load_tokenizer, train_bpe
    from polyshard.models import build_model, sequence_length, spec_of
    from polyshard.models.hf_adapters import hf_adapters
    from polyshard.trainer.checkpointing.hugging_face import export_note, model_settings, write_hf
    from polyshard.trainer.checkpointing.run_export import consolidate, export, saved_config
    from polyshard.trainer.checkpointing.run_reshard import reshard, target_config
    from polyshard.trainer.config import MESH_AXES, PRESETS, SCHEDULES, Config, apply_overrides, from_dict, load_config
    from polyshard.trainer.data.language import local_files
    from polyshard.trainer.engine.constraints import validate
    from polyshard.trainer.errors import ConfigError, DataError, NonFiniteError
    from polyshard.trainer.loop import sample_text, train
    from polyshard.trainer.loop.plan_check import PlannedStep
    from polyshard.trainer.runtime.launch import Launch, prepare_launch, read_settings
    from polyshard.trainer.runtime.lifetime import die_with_parent
