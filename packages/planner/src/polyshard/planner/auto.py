"""``polyshard train --layout auto``: the planner picks the layout a run starts with, and says why.

``polyshard train CONFIG --layout auto --nproc N`` calls :func:`choose` before launching: every
layout of the config's model on N processes is weighed (:func:`polyshard.planner.search.search`
with the given machine profile), the fastest that fits is written into the run's overrides
(:func:`overrides`), and its :func:`prediction` (step time, memory per pipeline rank) goes into the
run folder, so the run logs predicted against measured after its first steps
(:class:`polyshard.trainer.loop.plan_check.PlanCheck`). The axes written in the config are
replaced; the rest of it (model, batch, precision) is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyshard.planner.activations import activation_bytes
from polyshard.planner.model_states import rank_model_states
from polyshard.planner.profile import Profile
from polyshard.planner.report import table
from polyshard.planner.search import CHOSEN, Candidate, Plan, Request, label, search
from polyshard.trainer.config import Config
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop.plan_check import PlannedStep


def choose(
    config: Config,
    devices: int,
    profile: Profile,
    *,
    devices_per_node: int | None = None,
    memory_gb: float | None = None,
) -> Plan:
    """The ranked layouts of ``config``'s model on ``devices`` processes of ``profile``'s machine."""
    memory = memory_gb if memory_gb is not None else profile.memory_gb
    per_node = devices_per_node or min(devices, profile.devices_per_node)
    plan = search(config, Request(devices=devices, devices_per_node=per_node, memory_gb=memory), profile)
    if not plan.ranked:
        raise ConfigError(
            f"--layout auto: none of the {plan.considered} layouts of this model on {devices} processes fits in "
            f"{memory:g} GB per process; give more processes, a smaller training.global_batch_size or a shorter "
            "sequence, or set the layout by hand"
        )
    return plan


def laid_out(settings: Mapping[str, Any], chosen: Candidate) -> dict[str, Any]:
    """``settings`` (a config's sections, as read from its file and ``--set``) with the layout ``chosen``
    runs: its parallel sizes and styles, and its recompute. Values, not ``--set`` text: nothing is parsed
    again."""
    par, training = chosen.config.parallel, dict(settings.get("training", {}))
    parallel = dict(settings.get("parallel", {})) | {key: getattr(par, key) for key in CHOSEN}
    parallel["dp_shard"] = par.dp_shard
    training["activation_checkpointing"] = chosen.config.training.activation_checkpointing
    return {**settings, "parallel": parallel, "training": training}


def prediction(chosen: Candidate) -> PlannedStep:
    """What the run of ``chosen`` (the searched config laid out as it says) should measure: its step
    time and, per pipeline rank, the model-state bytes and the bytes saved for backward at peak."""
    config = chosen.config
    stages = range(config.parallel.pp)
    return PlannedStep(
        step_s=chosen.step_s,
        states_bytes=tuple(float(rank_model_states(config, rank).total) for rank in stages),
        activation_bytes=tuple(float(activation_bytes(config, rank)) for rank in stages),
    )


def explain(plan: Plan, top: int = 5) -> str:
    """The top candidates and why the first was chosen."""
    best = plan.ranked[0]
    parts = best.step.parts if best.step else {}
    share = ", ".join(f"{name} {seconds / best.step_s:.0%}" for name, seconds in parts.items() if seconds > 0)
    lines = [
        f"layout planner: {plan.considered} layouts considered, {plan.fitting} fit; the fastest of them:",
        table(plan.ranked[:top]),
        f"chose {label(best.config)}: the fastest predicted step ({best.step_s:.4g} s: {share}) among those that fit, "
        f"using {_size(best.memory.total)} of the heaviest rank's memory",
    ]
    if len(plan.ranked) > 1:
        runner = plan.ranked[1]
        lines[-1] += f"; next {label(runner.config)} at {runner.step_s:.4g} s (+{runner.step_s / best.step_s - 1:.0%})"
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.3g} MB"
