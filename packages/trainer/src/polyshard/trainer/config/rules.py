"""The rules between settings of different sections that need no world size, checked once the sections
are read (:func:`polyshard.trainer.config.from_dict`); those that depend on the mesh or the processes are
:func:`polyshard.trainer.engine.constraints.validate`'s."""

from __future__ import annotations

from polyshard.trainer.config.sections import Config
from polyshard.trainer.errors import ConfigError


def check_sections(config: Config) -> None:
    """The learning-rate schedule against the optimizer's rate and the run's steps."""
    schedule, lr, steps = config.lr_schedule, config.optimizer.lr, config.training.steps
    if schedule.min_lr > lr:
        raise ConfigError(f"need lr_schedule.min_lr ({schedule.min_lr}) <= optimizer.lr ({lr})")
    decay = schedule.decay_steps(steps)
    if schedule.name == "wsd" and schedule.warmup_steps > steps - decay:
        raise ConfigError(
            f"lr_schedule.warmup_steps={schedule.warmup_steps} overlaps the decay, which starts at step "
            f"{steps - decay} (lr_schedule.decay_fraction={schedule.decay_fraction} of training.steps={steps}); "
            "warm up for fewer steps or decay over a smaller fraction"
        )
