"""What runs beside the training step without being part of it: a :class:`Hook` is called at fixed
points of every step, on every rank, in the order the trainer holds the hooks (so a hook may run a
collective). The trainer's own: the profiler (:class:`~polyshard.trainer.loop.profiling.StepProfiler`),
the plan check (:class:`~polyshard.trainer.loop.plan_check.PlanCheck`), :class:`ReplicaCheck`,
:class:`FaultInjection`, and with ``training.compile`` :class:`CompileLog`. Steps are counted from 1, as
the progress line and ``metrics.jsonl`` count them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from polyshard.trainer.engine.compiling import CompileStats, compile_stats, graph_break_reasons
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.loop.faults import inject
from polyshard.trainer.loop.integrity import check_replicas
from polyshard.trainer.loop.step import TrainStepResult


class Hook:
    """A no-op at every point; a hook overrides the points it needs."""

    def begin_step(self, step: int) -> None:
        """Before anything of step ``step`` (its data included)."""

    def around_update(self, step: int) -> contextlib.AbstractContextManager[Any]:
        """Entered once the batch is taken, left after the optimizer step."""
        return contextlib.nullcontext()

    def before_zero_grad(self, step: int) -> None:
        """After the optimizer step, while the gradients are still held."""

    def after_update(self, step: int, measured: TrainStepResult) -> None:
        """What the step measured (loss, gradient norm, MTP losses, expert load, this rank's timeline),
        once the update is done and before the metrics record is made."""

    def after_step(self, step: int, seconds: float, record: dict[str, Any]) -> None:
        """The step's metrics record, before evaluation; a hook may add to it (the record is then logged)."""

    def before_save(self, step: int, saving: bool) -> None:
        """At the end of the step, before a checkpoint would be written (``saving``: one will be)."""

    def during_save(self, step: int) -> None:
        """This rank's checkpoint file is written, the index is not yet."""

    def after_save(self, step: int) -> None:
        """The step's checkpoint is published."""

    def end_step(self, step: int) -> None:
        """After the step's metrics, evaluation and checkpoint."""


compile_log = logging.getLogger("polyshard.trainer.compile")


class ReplicaCheck(Hook):
    """Every ``every`` steps and before each save: one all-gather of a checksum per rank finds a
    data-parallel replica whose weights drifted (:func:`~polyshard.trainer.loop.integrity.check_replicas`);
    the run stops before such weights are saved."""

    def __init__(self, engine: Engine, every: int):
        self.engine, self.every = engine, every

    def before_save(self, step: int, saving: bool) -> None:
        if saving or (self.every and step % self.every == 0):
            check_replicas(self.engine, step)


class FaultInjection(Hook):
    """``POLYSHARD_FAULT`` kill points (:mod:`~polyshard.trainer.loop.faults`) on this rank: ``step``
    mid-step (the batch taken, the weights not yet updated), ``save`` mid-save, ``saved`` after it."""

    def __init__(self, rank: int):
        self.rank = rank

    @contextlib.contextmanager
    def _killed_here(self, step: int) -> Iterator[None]:
        inject("step", step, self.rank)
        yield

    def around_update(self, step: int) -> contextlib.AbstractContextManager[Any]:
        return self._killed_here(step)

    def during_save(self, step: int) -> None:
        inject("save", step, self.rank)

    def after_save(self, step: int) -> None:
        inject("saved", step, self.rank)


class CompileLog(Hook):
    """Adds ``compile`` (a :class:`CompileStats`) to a step's metrics when it changed: the first step's
    compiles, then only a recompile shows up. Logs each graph break's reason at DEBUG."""

    def __init__(self) -> None:
        self.last: CompileStats | None = None
        self.reasons: dict[str, int] = {}

    def after_step(self, step: int, seconds: float, record: dict[str, Any]) -> None:
        stats = compile_stats()
        if self.last is not None and stats.frames == self.last.frames:
            return
        record["compile"] = asdict(stats)
        if self.last is not None and stats.recompiles > self.last.recompiles:
            compile_log.info("step %d recompiled (%d so far): TORCH_LOGS=recompiles says why", step, stats.recompiles)
        self.last = stats
        reasons = graph_break_reasons()
        for reason, count in reasons.items():
            if reason not in self.reasons:
                compile_log.debug("graph break (%d so far at step %d): %s", count, step, reason)
        self.reasons = reasons
