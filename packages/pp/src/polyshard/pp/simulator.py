"""A tensor-free simulator: run a lowered schedule against its dependencies.

Each rank walks its steps in order with a clock. A compute step starts when
the rank is free and its same-rank inputs exist, and lasts its cost. An
exchange posts all its sends and receives when the rank reaches it, as the
executor does with one batch of isend/irecv; the rank waits for its receives
only (a receive completes once its send is posted) and lets the sends finish
in the background, so a send never blocks the sender. If no rank can move and some have steps left, the schedule
deadlocks: :class:`DeadlockError` names the rank and action and prints the
rank x step grid with each stuck step marked ``>>...<<``.

Costs are seconds (or any unit) per action: a mapping by kind (default F = B = W = 1) or a
function of the action, so each stage may cost its own (the planner passes measured rates this
way; :func:`measured_costs` reads them off an executor's timeline). A backward that is not
split (no W for it) costs B + W: with the defaults it is 2 units wide, as the drawings show.
``comm_cost`` is the time a receive takes once its send is posted (point-to-point transfer).
Figures reported:

* total time; bubble fraction = idle / (ranks x total time);
* peak in-flight activations per rank: (stage, microbatch) pairs whose F
  has run and whose B has not (each holds the stage's stored activations).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from polyshard.pp.actions import Action, Exchange, Schedule
from polyshard.pp.errors import DeadlockError, ScheduleError
from polyshard.pp.lowering import Program, format_program, lower
from polyshard.pp.timeline import Span, Timeline

DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}
CostFn = Callable[[Action], float]
"""Seconds one action takes: forward (F), input-backward (B) or weight-backward (W) of a stage."""


@dataclass(frozen=True)
class SimResult:
    schedule: Schedule
    program: Program
    total_time: float
    bubble_fraction: float
    peak_activations: tuple[int, ...]
    timeline: Timeline


def check_complete(schedule: Schedule) -> None:
    """Every stage on a rank must run F and B exactly once per microbatch (and W at most once)."""
    for rank, actions in enumerate(schedule.actions):
        seen = [(a.kind, a.stage, a.microbatch) for a in actions]
        for a in actions:
            if schedule.rank_of(a.stage) != rank or not 0 <= a.microbatch < schedule.num_microbatches:
                raise ScheduleError(f"rank {rank}: action {a} does not belong on this rank or microbatch range")
        for stage in schedule.stages_of(rank):
            for k in range(schedule.num_microbatches):
                for kind in ("F", "B", "W"):
                    count = seen.count((kind, stage, k))
                    if (kind != "W" and count != 1) or count > 1:
                        raise ScheduleError(
                            f"rank {rank}: action {stage}{kind}{k} appears {count} times; F and B must appear "
                            "exactly once per stage and microbatch, W at most once"
                        )


def _cost(schedule: Schedule, action: Action, costs: CostFn) -> float:
    if action.kind == "B" and (action.stage, action.microbatch) not in schedule.split_backward:
        return costs(action) + costs(Action("W", action.stage, action.microbatch))
    return costs(action)


def measured_costs(timeline: Timeline) -> dict[str, float]:
    """Median seconds per F, B and W span of a measured timeline (an executor's, through
    :func:`gather_timeline`), and per exchange as ``"p2p"``: costs to simulate the same run with.
    A backward that was not split is measured whole: its W is 0 then."""
    durations: dict[str, list[float]] = {}
    for span in timeline.spans:
        durations.setdefault(span.kind, []).append(span.end - span.start)
    costs = {kind: statistics.median(durations[kind]) if durations.get(kind) else 0.0 for kind in ("F", "B", "W")}
    costs["p2p"] = statistics.median(durations["X"]) if durations.get("X") else 0.0
    return costs


def _local_inputs(schedule: Schedule, rank: int, action: Action) -> list[tuple[str, int, int]]:
    """Compute results on this same rank that ``action`` needs (other ranks' come through exchanges)."""
    s, k, last = action.stage, action.microbatch, schedule.num_stages - 1
    if action.kind == "F":
        return [("F", s - 1, k)] if s > 0 and schedule.rank_of(s - 1) == rank else []
    if action.kind == "B":
        needs = [("F", s, k)]
        return needs + ([("B", s + 1, k)] if s < last and schedule.rank_of(s + 1) == rank else [])
    return [("B", s, k)]


class _Run:
    def __init__(self, schedule: Schedule, program: Program, costs: CostFn, comm_cost: float):
        self.schedule, self.program, self.costs, self.comm_cost = schedule, program, costs, comm_cost
        p = schedule.num_ranks
        self.pc, self.clock = [0] * p, [0.0] * p
        self.posted: dict[tuple[str, int, int], float] = {}  # message key -> time its send was posted
        self.finished: dict[tuple[str, int, int], float] = {}
        self.in_flight, self.peak = [0] * p, [0] * p
        self.spans: list[Span] = []

    def step(self, rank: int) -> bool:
        """Try to run rank's next step; True when it ran."""
        step = self.program[rank][self.pc[rank]]
        if isinstance(step, Exchange):
            return self._exchange(rank, step)
        needs = _local_inputs(self.schedule, rank, step)
        if any(n not in self.finished for n in needs):
            return False
        start = max([self.clock[rank]] + [self.finished[n] for n in needs])
        end = start + _cost(self.schedule, step, self.costs)
        self.finished[(step.kind, step.stage, step.microbatch)] = end
        self.spans.append(Span(rank, str(step), step.kind, start, end))
        self.in_flight[rank] += {"F": 1, "B": -1}.get(step.kind, 0)
        self.peak[rank] = max(self.peak[rank], self.in_flight[rank])
        self.clock[rank], self.pc[rank] = end, self.pc[rank] + 1
        return True

    def _exchange(self, rank: int, step: Exchange) -> bool:
        for op in step.ops:
            if op.kind.startswith("S"):
                self.posted.setdefault(op.message_key(), self.clock[rank])
        keys = [op.message_key() for op in step.ops if op.kind.startswith("R")]
        if any(key not in self.posted for key in keys):
            return False
        self.clock[rank] = max([self.clock[rank], *(self.posted[key] for key in keys)]) + self.comm_cost
        self.pc[rank] += 1
        return True

    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for rank in range(self.schedule.num_ranks):
                while self.pc[rank] < len(self.program[rank]) and self.step(rank):
                    moved = True

    def stuck(self) -> list[int]:
        return [r for r in range(self.schedule.num_ranks) if self.pc[r] < len(self.program[r])]


def deadlock_grid(program: Program, pcs: list[int]) -> str:
    """Rank x step grid (step numbers on top) with each rank's stuck step marked ``>>...<<``."""
    cells = [[str(s) for s in steps] for steps in program]
    for rank, pc in enumerate(pcs):
        if pc < len(cells[rank]):
            cells[rank][pc] = f">>{cells[rank][pc]}<<"
    width = max(len(c) for row in cells for c in row) + 1
    columns = max(len(row) for row in cells)
    header = "step    " + "".join(f"{i:<{width}}" for i in range(columns))
    rows = [f"rank {r:<3}" + "".join(f"{c:<{width}}" for c in row) for r, row in enumerate(cells)]
    return "\n".join([header, *rows])


def _deadlock(run: _Run) -> DeadlockError:
    rank = run.stuck()[0]
    step = run.program[rank][run.pc[rank]]
    if isinstance(step, Exchange):
        op = next(op for op in step.ops if op.kind.startswith("R") and op.message_key() not in run.posted)
        peer = run.schedule.rank_of(op.stage + (1 if op.kind == "RB" else -1))
        pc = run.pc[peer]
        peer_at = f"step {pc} ({run.program[peer][pc]})" if pc < len(run.program[peer]) else "the end"
        kind, stage, k = op.message_key()
        why = f"its {op} needs rank {peer} to send {stage}S{kind}{k}, but rank {peer} is stuck at {peer_at}"
    else:
        why = f"{step} needs {', '.join(f'{s}{k}{m}' for k, s, m in _local_inputs(run.schedule, rank, step))} first"
    message = f"schedule {run.schedule.name!r} deadlocks: rank {rank} waits forever at step {run.pc[rank]} ({step}): "
    return DeadlockError(message + why, rank, str(step), deadlock_grid(run.program, run.pc))


def simulate(
    schedule: Schedule,
    costs: Mapping[str, float] | CostFn | None = None,
    *,
    comm_cost: float = 0.0,
    program: Program | None = None,
) -> SimResult:
    """Run ``schedule`` (or an already lowered ``program`` for it) without tensors. ``costs``: per
    kind (missing kinds cost 1), or a function of each action (per stage, say)."""
    if callable(costs):
        cost_of: CostFn = costs
    else:
        table = {**DEFAULT_COSTS, **(costs or {})}
        cost_of = lambda action: table[action.kind]  # noqa: E731
    check_complete(schedule)
    program = lower(schedule) if program is None else program
    run = _Run(schedule, program, cost_of, comm_cost)
    run.run()
    if run.stuck():
        raise _deadlock(run)
    total = max(run.clock) if run.clock else 0.0
    busy = sum(s.end - s.start for s in run.spans)
    bubble = 1.0 - busy / (schedule.num_ranks * total) if total > 0 else 0.0
    timeline = Timeline(schedule.num_ranks, tuple(run.spans), with_stage=schedule.virtual_stages > 1)
    return SimResult(schedule, program, total, bubble, tuple(run.peak), timeline)


__all__ = [
    "DEFAULT_COSTS",
    "CostFn",
    "SimResult",
    "check_complete",
    "deadlock_grid",
    "format_program",
    "measured_costs",
    "simulate",
]
