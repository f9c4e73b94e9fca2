"""``logging.profile_steps = [first, last]``: where the time of those steps goes.

Every rank runs ``torch.profiler`` (CPU activities, and CUDA when a GPU is there)
over steps first..last and writes ``<run>/profile/rank<N>.json``, a Chrome trace
(open it in chrome://tracing or ui.perfetto.dev; each step is a ``step N`` range).

With pp > 1 the pipeline executor's timeline of the last profiled step is
gathered over each pipeline group, and rank 0 writes its group's as
``profile/pipeline.txt`` and ``profile/pipeline.svg``: the measured timeline
above the simulator's run of the same schedule and lowered program with the
median F, B and W times measured in that step (``polyshard.pp.measured_costs``;
each exchange keeps its rank busy for the mean time posting one took), drawn on one time
scale by the pp package's :class:`~polyshard.pp.Timeline` renderers, with both
bubble fractions. The gap between them is what communication waits and Python
between actions cost. Spans are ``perf_counter`` readings, one clock on one
host: a pipeline group spread over several nodes shows their clocks' offsets.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from polyshard.pp import Timeline, gather_timeline, measured_costs, simulate
from polyshard.trainer.config import Config
from polyshard.trainer.loop.hooks import Hook
from polyshard.trainer.loop.step import TrainStepResult

FOLDER = "profile"


class StepProfiler(Hook):
    """Profiles steps ``first..last`` of ``logging.profile_steps`` (the part of them this run reaches:
    a run resumed past ``first`` starts at its first step, one that stops before ``last`` ends there)."""

    def __init__(self, config: Config, engine: Any, out: Path, end: int):
        steps = config.logging.profile_steps
        self.first, self.last = (steps[0], min(steps[1], end)) if steps else (1, 0)
        self.config, self.engine, self.folder = config, engine, Path(out) / FOLDER
        self.profiler: torch.profiler.profile | None = None
        self.range: torch.profiler.record_function | None = None  # the step's range in the trace
        self.timeline: Timeline | None = None  # this rank's spans of the last profiled step

    def begin_step(self, step: int) -> None:
        """At the start of step ``step`` (counted from 1), on every rank."""
        if not self.first <= step <= self.last:
            return
        if self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        self.range = torch.profiler.record_function(f"step {step}")
        self.range.__enter__()

    def after_update(self, step: int, measured: TrainStepResult) -> None:
        if step == self.last:
            self.timeline = measured.timeline

    def end_step(self, step: int) -> None:
        """At the end of step ``step``, after its metrics, evaluation and checkpoint, on every rank."""
        if not self.first <= step <= self.last:
            return
        assert self.range is not None
        self.range.__exit__(None, None, None)
        self.range = None
        if step == self.last:
            self._finish(step)

    def _finish(self, step: int) -> None:
        assert self.profiler is not None
        self.profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.folder / f"rank{dist.get_rank()}.json"))
        self.profiler = None
        if self.config.parallel.pp > 1:
            self._pipeline(step)

    def _pipeline(self, step: int) -> None:
        """Gather the step's timeline over every pipeline group (a collective); rank 0 writes its group's."""
        engine, executor = self.engine, self.engine.executor
        assert self.timeline is not None, "after_update keeps the last profiled step's timeline"
        measured = gather_timeline(
            self.timeline, executor.schedule, engine.mesh.group("pp"), engine.device, program=executor.program
        )
        if dist.get_rank() == 0:
            txt, svg = pipeline_report(measured, executor.schedule, executor.program, self._title(step))
            (self.folder / "pipeline.txt").write_text(txt)
            (self.folder / "pipeline.svg").write_text(svg)

    def _title(self, step: int) -> str:
        par = self.config.parallel
        v = f" v={par.virtual_stages}" if par.virtual_stages > 1 else ""
        return f"step {step}, {par.schedule} pp={par.pp} m={par.microbatches}{v} (the pipeline group of rank 0)"


def predicted_timeline(measured: Timeline, schedule: Any, program: Any) -> tuple[Timeline, dict[str, float]]:
    """The simulator's timeline of ``schedule`` (as lowered in ``program``) with the costs measured in
    ``measured``, and those costs (seconds)."""
    costs = measured_costs(measured)
    table = {kind: costs[kind] for kind in ("F", "B", "W")}
    return simulate(schedule, table, post_cost=costs["post"], program=program).timeline, costs


def pipeline_report(measured: Timeline, schedule: Any, program: Any, title: str) -> tuple[str, str]:
    """(pipeline.txt, pipeline.svg): the measured timeline above the simulator's prediction from its
    costs, on one time scale."""
    predicted, costs = predicted_timeline(measured, schedule, program)
    longest = max(measured.total_time, predicted.total_time) or 1.0
    ms = {kind: f"{seconds * 1e3:.3g} ms" for kind, seconds in costs.items()}
    width = 100
    lines = [
        f"pipeline timeline, {title}",
        f"measured: {measured.total_time * 1e3:.2f} ms",
        measured.render_text(_share(width, measured, longest)),
        "",
        f"simulator, from the measured median costs (F {ms['F']}, B {ms['B']}, W {ms['W']}, "
        f"posting an exchange {ms['post']}): {predicted.total_time * 1e3:.2f} ms",
        predicted.render_text(_share(width, predicted, longest)),
        "",
        f"bubble measured {measured.bubble_fraction:.3f} | simulator {predicted.bubble_fraction:.3f}",
        "where each rank's measured step went (ms): compute, posting sends/receives, waiting for data, other",
        *(
            f"rank {r:<3} " + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in measured.breakdown(r).items())
            for r in range(measured.num_ranks)
        ),
    ]
    svg_width = 900
    parts = [
        measured.to_svg(
            f"measured, {title}: {measured.total_time * 1e3:.2f} ms, bubble {measured.bubble_fraction:.3f}",
            width=_svg_share(svg_width, measured, longest),
        ),
        predicted.to_svg(
            f"simulator from the measured costs: {predicted.total_time * 1e3:.2f} ms, "
            f"bubble {predicted.bubble_fraction:.3f}",
            width=_svg_share(svg_width, predicted, longest),
        ),
    ]
    return "\n".join(lines) + "\n", stack_svg(parts, svg_width)


def _share(width: int, timeline: Timeline, longest: float) -> int:
    """Characters for ``timeline`` so that both drawings share one time scale."""
    return max(10, round(width * timeline.total_time / longest))


def _svg_share(width: int, timeline: Timeline, longest: float) -> int:
    left, right = 60, 10  # Timeline.to_svg's margins
    return left + right + max(100, round((width - left - right) * timeline.total_time / longest))


def stack_svg(parts: list[str], width: int) -> str:
    """SVG documents (as :meth:`Timeline.to_svg` writes them) one above the other in one document."""
    body, y = [], 0
    for part in parts:
        match = re.search(r'height="(\d+)"', part)
        assert match is not None, "an SVG document without its height"
        height = int(match.group(1))
        part = part.replace("<svg ", '<svg overflow="visible" ', 1)  # a narrower drawing keeps its whole legend
        body.append(f'<g transform="translate(0,{y})">\n{part}\n</g>')
        y += height
    head = f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" font-family="monospace">'
    return "\n".join([head, f'<rect width="{width}" height="{y}" fill="white"/>', *body, "</svg>"])
