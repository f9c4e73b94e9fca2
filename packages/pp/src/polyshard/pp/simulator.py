"""A tensor-free simulator: run a lowered schedule against its dependencies.

Each rank walks its steps in order with a clock. A compute step starts when
the rank is free and its same-rank inputs exist, and lasts its cost. An
exchange posts all its sends and receives when the rank reaches it, as the
executor does with one batch of isend/irecv; the rank waits for its receives
only (a receive completes once its send is posted) and lets the sends finish
in the background, so a send never blocks the sender. If no rank can move and some have steps left, the schedule
deadlocks: :class:`DeadlockError` names the rank and action and prints the
rank x step grid with each stuck step marked ``>>...<<``.

Costs default to F = B = W = 1, where B is the input-gradient half of a
backward (``BACKWARD_INPUT``) and W the weight half; a full ``BACKWARD``
costs B + W. Figures reported:

* total time; bubble fraction = idle / (ranks x total time);
* peak in-flight activations per rank: (stage, microbatch) pairs whose F
  has run and whose backward (full or input half) has not (each holds the
  stage's stored activations).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from polyshard.pp.actions import Action, Exchange, Kind, Schedule
from polyshard.pp.errors import DeadlockError, ScheduleError
from polyshard.pp.lowering import Program, format_program, lower
from polyshard.pp.timeline import Span, Timeline

COMPUTE_ORDER = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}


@dataclass(frozen=True)
class SimResult:
    schedule: Schedule
    program: Program
    total_time: float
    bubble_fraction: float
    peak_activations: tuple[int, ...]
    timeline: Timeline


def check_complete(schedule: Schedule) -> None:
    """Every stage on a rank runs, per microbatch, one FORWARD and either one BACKWARD or one
    BACKWARD_INPUT and one BACKWARD_WEIGHT (in that order; the simulator checks the order)."""
    for rank, actions in enumerate(schedule.actions):
        counts = Counter(actions)
        for a in actions:
            if not a.kind.is_compute:
                raise ScheduleError(f"rank {rank}: {a} is a communication action; schedules list compute only")
            if schedule.rank_of(a.stage) != rank or not 0 <= a.microbatch < schedule.num_microbatches:
                raise ScheduleError(f"rank {rank}: action {a} does not belong on this rank or microbatch range")
        for stage in schedule.stages_of(rank):
            for k in range(schedule.num_microbatches):
                f, b, i, w = (counts[Action(kind, stage, k)] for kind in COMPUTE_ORDER)
                if f != 1 or (b, i, w) not in ((1, 0, 0), (0, 1, 1)):
                    raise ScheduleError(
                        f"rank {rank}: stage {stage} microbatch {k} has {f} forward, {b} full backward, {i} input "
                        f"backward and {w} weight backward; it needs one forward and either one full backward or "
                        "one input backward and one weight backward"
                    )


def _cost(action: Action, costs: Mapping[str, float]) -> float:
    if action.kind is Kind.BACKWARD:
        return costs["B"] + costs["W"]
    return costs[action.kind.letter]


def _local_inputs(schedule: Schedule, rank: int, action: Action) -> list[Action]:
    """Compute actions on this same rank that ``action`` needs (other ranks' results come through exchanges)."""
    s, k, last = action.stage, action.microbatch, schedule.num_stages - 1
    if action.kind is Kind.FORWARD:
        return [Action(Kind.FORWARD, s - 1, k)] if s > 0 and schedule.rank_of(s - 1) == rank else []
    if action.kind.ends_activation:
        needs = [Action(Kind.FORWARD, s, k)]
        if s < last and schedule.rank_of(s + 1) == rank:
            # the gradient of stage s+1's input, from its full or its input-half backward
            split = Action(Kind.BACKWARD_INPUT, s + 1, k)
            needs.append(split if split in schedule.actions[rank] else Action(Kind.BACKWARD, s + 1, k))
        return needs
    return [Action(Kind.BACKWARD_INPUT, s, k)]


class _Run:
    def __init__(self, schedule: Schedule, program: Program, costs: Mapping[str, float], comm_cost: float):
        self.schedule, self.program, self.costs, self.comm_cost = schedule, program, costs, comm_cost
        p = schedule.num_ranks
        self.pc, self.clock = [0] * p, [0.0] * p
        self.posted: dict[Action, float] = {}  # message key -> time its send was posted
        self.finished: dict[Action, float] = {}
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
        end = start + _cost(step, self.costs)
        self.finished[step] = end
        self.spans.append(Span(rank, str(step), step.kind.letter, start, end))
        self.in_flight[rank] += 1 if step.kind is Kind.FORWARD else -1 if step.kind.ends_activation else 0
        self.peak[rank] = max(self.peak[rank], self.in_flight[rank])
        self.clock[rank], self.pc[rank] = end, self.pc[rank] + 1
        return True

    def _exchange(self, rank: int, step: Exchange) -> bool:
        for op in step.ops:
            if op.kind.is_send:
                self.posted.setdefault(op.message_key(), self.clock[rank])
        keys = [op.message_key() for op in step.ops if op.kind.is_recv]
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
        op = next(op for op in step.ops if op.kind.is_recv and op.message_key() not in run.posted)
        key = op.message_key()
        peer = run.schedule.rank_of(key.stage)
        pc = run.pc[peer]
        peer_at = f"step {pc} ({run.program[peer][pc]})" if pc < len(run.program[peer]) else "the end"
        why = f"its {op} needs rank {peer} to send {key}, but rank {peer} is stuck at {peer_at}"
    else:
        why = f"{step} needs {', '.join(str(a) for a in _local_inputs(run.schedule, rank, step))} first"
    message = f"schedule {run.schedule.name!r} deadlocks: rank {rank} waits forever at step {run.pc[rank]} ({step}): "
    return DeadlockError(message + why, rank, str(step), deadlock_grid(run.program, run.pc))


def simulate(
    schedule: Schedule,
    costs: Mapping[str, float] | None = None,
    *,
    comm_cost: float = 0.0,
    program: Program | None = None,
) -> SimResult:
    """Run ``schedule`` (or an already lowered ``program`` for it) without tensors."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    check_complete(schedule)
    program = lower(schedule) if program is None else program
    run = _Run(schedule, program, costs, comm_cost)
    run.run()
    if run.stuck():
        raise _deadlock(run)
    total = max(run.clock) if run.clock else 0.0
    busy = sum(s.end - s.start for s in run.spans)
    bubble = 1.0 - busy / (schedule.num_ranks * total) if total > 0 else 0.0
    timeline = Timeline(schedule.num_ranks, tuple(run.spans), with_stage=schedule.virtual_stages > 1)
    return SimResult(schedule, program, total, bubble, tuple(run.peak), timeline)


__all__ = ["DEFAULT_COSTS", "SimResult", "check_complete", "deadlock_grid", "format_program", "simulate"]
