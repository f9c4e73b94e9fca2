"""The rules between settings — of one section or of several — that need no processes: checked once the
sections are read (:func:`polyshard.trainer.config.from_dict`) and again by
:func:`polyshard.trainer.engine.constraints.validate` (which adds the rules about the mesh against the
processes and the model: heads vs tp, layers vs stages, ...), so a layout the planner builds is held to
them too. Each section's own fields are checked for their type and range where they are declared
(:mod:`polyshard.trainer.config.sections`)."""

from __future__ import annotations

from polyshard.mesh import divisors
from polyshard.trainer.config.sections import V_SCHEDULES, Config, ParallelConfig
from polyshard.trainer.errors import ConfigError


def check_sections(config: Config) -> None:
    """Every rule below, in order; the first one broken raises a :class:`ConfigError` naming the fields."""
    _pipeline_schedule(config.parallel)
    _hybrid_sharding(config.parallel)
    _ulysses_ring(config.parallel)
    _learning_rate(config)
    if config.training.stop_at > config.training.steps:
        steps = config.training.steps
        raise ConfigError(f"training.stop_at={config.training.stop_at} is past training.steps={steps}; give 1..steps")


def _pipeline_schedule(par: ParallelConfig) -> None:
    """A V schedule runs two stages per pipeline rank; only it and the interleaved one run several."""
    if par.schedule in V_SCHEDULES and par.virtual_stages != 2:
        raise ConfigError(
            f"parallel.schedule={par.schedule!r} puts two stages on each pipeline rank (a V); "
            f"set parallel.virtual_stages=2 (got {par.virtual_stages})"
        )
    if par.virtual_stages > 1 and par.schedule not in ("interleaved", *V_SCHEDULES):
        raise ConfigError(
            f"parallel.virtual_stages={par.virtual_stages} needs parallel.schedule='interleaved' "
            f"(or 'zb-v' / 'dualpipev' with 2; got {par.schedule!r}); set virtual_stages=1 or switch the schedule"
        )


def _hybrid_sharding(par: ParallelConfig) -> None:
    """dp_shard splits dp, and sharding needs a ZeRO stage."""
    if par.dp_shard is None:
        return
    if isinstance(par.dp, int) and par.dp % par.dp_shard:
        raise ConfigError(
            f"parallel.dp_shard={par.dp_shard} must divide parallel.dp={par.dp}; choose dp_shard in {divisors(par.dp)}"
        )
    if par.hybrid and par.zero_stage == 0:
        raise ConfigError(
            f"parallel.dp_shard={par.dp_shard} (hybrid sharding) needs parallel.zero_stage 1, 2 or 3: "
            "at stage 0 nothing is sharded; set zero_stage or remove dp_shard"
        )


def _ulysses_ring(par: ParallelConfig) -> None:
    """cp_ulysses is the all-to-all part of cp under 'ulysses+ring', and only there."""
    if par.cp_style != "ulysses+ring":
        if par.cp_ulysses is not None:
            raise ConfigError(
                f"parallel.cp_ulysses={par.cp_ulysses} applies to cp_style 'ulysses+ring' only (got "
                f"{par.cp_style!r}); remove cp_ulysses or set cp_style = 'ulysses+ring'"
            )
        return
    inner = [d for d in divisors(par.cp) if 1 < d < par.cp]
    if par.cp_ulysses is None or par.cp_ulysses not in inner:
        fix = f"choose cp_ulysses in {inner}" if inner else "use cp_style 'ulysses' or 'ring' (cp has no such split)"
        raise ConfigError(
            f"parallel.cp_style='ulysses+ring' needs parallel.cp_ulysses, the all-to-all part of cp={par.cp}: a "
            f"divisor of cp between 1 and cp (got {par.cp_ulysses}); {fix}"
        )


def _learning_rate(config: Config) -> None:
    """The schedule's floor under the optimizer's rate, and wsd's warmup before its decay."""
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
