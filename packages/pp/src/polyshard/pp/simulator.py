"""A tensor-free simulator: run a lowered schedule against its dependencies.

Each rank walks its steps in order with a clock, as the executor does:

* an :class:`Exchange` posts its sends and receives at the rank's clock and never blocks
  on its peer; posting itself keeps the rank busy for ``post_cost`` (on gloo each
  isend/irecv call costs CPU time), drawn as an ``X`` span and counted as idle, as the
  executor's measured timelines count it;
* a :class:`Wait` blocks until each of its receives holds data: ``comm_cost`` after
  both the send and the receive are posted (on gloo a transfer starts only then);
* a compute step starts when the rank is free and its same-rank inputs exist, and
  lasts its cost.

If no rank can move and some have steps left, the schedule deadlocks:
:class:`DeadlockError` names the rank and action and prints the rank x step grid
with each stuck step marked ``>>...<<``.

Costs default to F = B = W = 1, where B is the input-gradient half of a backward
(``BACKWARD_INPUT``) and W the weight half; a full ``BACKWARD`` costs B + W. With
an ``"F&B"`` cost, each of the schedule's overlapped (forward, backward) pairs runs
as one unit of that cost once both halves' inputs are ready (DualPipe's overlapped
chunks); without it they run one after the other, as the executor does. ``costs``
may also be a function of the action (e.g. times measured on a real run). Figures:

* total time; bubble fraction = idle / (ranks x total time);
* peak in-flight activations per rank: (stage, microbatch) pairs whose F has run
  and whose backward (full or input half) has not (each holds the stage's stored
  activations).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from polyshard.pp.actions import Action, Exchange, Kind, Schedule, Wait
from polyshard.pp.checks import check_complete, check_program
from polyshard.pp.errors import DeadlockError
from polyshard.pp.lowering import Program, format_program, lower, peer_of
from polyshard.pp.timeline import Span, Timeline

DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}
Costs = Mapping[str, float] | Callable[[Action], float]


@dataclass(frozen=True)
class SimResult:
    schedule: Schedule
    program: Program
    total_time: float
    bubble_fraction: float
    peak_activations: tuple[int, ...]
    timeline: Timeline

    def idle_within(self, rank: int) -> float:
        """Idle time of ``rank`` between the start of its first action and the end of its last (the
        zero-bubble papers' "bubble": the start-up stagger before a rank's first action is not in it)."""
        spans = [s for s in self.timeline.spans if s.rank == rank]
        if not spans:
            return 0.0
        return max(s.end for s in spans) - min(s.start for s in spans) - sum(s.end - s.start for s in spans)


def _cost_function(costs: Costs | None) -> tuple[Callable[[Action], float], float | None]:
    """(cost of one action, cost of an overlapped F&B pair or None to run pairs one after the other)."""
    if callable(costs):
        return costs, None
    table = {**DEFAULT_COSTS, **(costs or {})}

    def cost(action: Action) -> float:
        if action.kind is Kind.BACKWARD:
            return table["B"] + table["W"]
        return table[action.kind.letter]

    return cost, table.get("F&B")


def measured_costs(timeline: Timeline) -> dict[str, float]:
    """Median seconds per F, B and W span of a measured timeline (an executor's, through
    :func:`gather_timeline`), and the mean seconds of posting an exchange as ``"post"``
    (``simulate``'s ``post_cost``; the mean, so the step's total posting time is kept: a few
    postings take far longer than most): costs to simulate the same run with. A backward that was
    not split is measured whole; W is 0 then."""
    durations: dict[str, list[float]] = {}
    for span in timeline.spans:
        durations.setdefault(span.kind, []).append(span.end - span.start)
    costs = {kind: statistics.median(durations[kind]) if durations.get(kind) else 0.0 for kind in ("F", "B", "W")}
    costs["post"] = statistics.fmean(durations["X"]) if durations.get("X") else 0.0
    return costs


def _local_inputs(schedule: Schedule, rank: int, action: Action) -> list[Action]:
    """Compute actions on this same rank that ``action`` needs (other ranks' results come through waits)."""
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
    def __init__(self, schedule: Schedule, program: Program, costs: Costs | None, comm_cost: float, post_cost: float):
        self.schedule, self.program, self.comm_cost, self.post_cost = schedule, program, comm_cost, post_cost
        self.cost, self.pair_cost = _cost_function(costs)
        self.partner = dict(schedule.overlapped) if self.pair_cost is not None else {}
        p = schedule.num_ranks
        self.pc, self.clock = [0] * p, [0.0] * p
        self.sent: dict[Action, float] = {}  # message key -> time its send was posted
        self.receiving: dict[Action, float] = {}  # receive -> time it was posted
        self.finished: dict[Action, float] = {}
        self.in_flight, self.peak = [0] * p, [0] * p
        self.spans: list[Span] = []

    def step(self, rank: int) -> bool:
        """Try to run rank's next step; True when it ran."""
        step = self.program[rank][self.pc[rank]]
        if isinstance(step, Exchange):
            start = self.clock[rank]
            self.clock[rank] = start + self.post_cost
            if self.post_cost > 0:
                self.spans.append(Span(rank, "post", "X", start, self.clock[rank]))
            self._post(rank, step, self.clock[rank])
        elif isinstance(step, Wait):
            arrived = self._arrival(step.ops)
            if arrived is None:
                return False
            self.clock[rank] = max(self.clock[rank], arrived)
        elif step in self.partner:
            return self._pair(rank, step)
        else:
            ready = self._ready(rank, step)
            if ready is None:
                return False
            start = max(self.clock[rank], ready)
            self._compute(rank, step, start, start + self.cost(step))
        self.pc[rank] += 1
        return True

    def _post(self, rank: int, step: Exchange, at: float, sends: bool = True, receives: bool = True) -> None:
        for op in step.ops:
            if op.kind.is_send and sends:
                self.sent.setdefault(op, at)
            elif op.kind.is_recv and receives:
                self.receiving.setdefault(op, at)

    def _arrival(self, ops: tuple[Action, ...]) -> float | None:
        """When the data of every receive in ``ops`` is there; None while a send is not yet posted."""
        keys = [op.message_key() for op in ops]
        if any(key not in self.sent for key in keys):
            return None
        return max(max(self.sent[key], self.receiving[op]) + self.comm_cost for op, key in zip(ops, keys))

    def _ready(self, rank: int, action: Action) -> float | None:
        needs = _local_inputs(self.schedule, rank, action)
        if any(n not in self.finished for n in needs):
            return None
        return max([0.0] + [self.finished[n] for n in needs])

    def _compute(self, rank: int, action: Action, start: float, end: float) -> None:
        self.finished[action] = end
        self.spans.append(Span(rank, str(action), action.kind.letter, start, end))
        self.in_flight[rank] += 1 if action.kind is Kind.FORWARD else -1 if action.kind.ends_activation else 0
        self.peak[rank] = max(self.peak[rank], self.in_flight[rank])
        self.clock[rank] = end

    def _pair(self, rank: int, forward: Action) -> bool:
        """An overlapped F&B: both halves start once both are ready and end together after the pair's
        cost. Steps between them (the backward's receives, the forward's sends) happen around the unit."""
        steps, pc = self.program[rank], self.pc[rank]
        end = steps.index(self.partner[forward], pc)
        backward, between = steps[end], steps[pc + 1 : end]
        assert isinstance(backward, Action) and self.pair_cost is not None
        for step in between:  # receives are posted before the unit starts
            if isinstance(step, Exchange):
                self._post(rank, step, self.clock[rank], sends=False)
        ready = [self._ready(rank, forward), self._ready(rank, backward)]
        ready += [self._arrival(step.ops) for step in between if isinstance(step, Wait)]
        if any(r is None for r in ready):
            return False
        start = max([self.clock[rank]] + [r for r in ready if r is not None])
        finish = start + self.pair_cost
        # drawn as two spans, split in proportion to the halves' own costs
        cost_f, cost_b = self.cost(forward), self.cost(backward)
        middle = start + self.pair_cost * (cost_f / (cost_f + cost_b) if cost_f + cost_b > 0 else 0.5)
        self._compute(rank, forward, start, middle)
        self._compute(rank, backward, middle, finish)
        self.finished[forward] = finish  # both halves' results exist only when the unit ends
        for step in between:  # so the forward's output leaves then
            if isinstance(step, Exchange):
                self._post(rank, step, finish, receives=False)
        self.pc[rank] = end + 1
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
    waits: tuple[Action, ...] = step.ops if isinstance(step, Wait) else ()
    if isinstance(step, Action) and step in run.partner:  # an F&B unit also waits for its backward's data
        end = run.program[rank].index(run.partner[step], run.pc[rank])
        waits = tuple(op for s in run.program[rank][run.pc[rank] : end] if isinstance(s, Wait) for op in s.ops)
    missing = [op for op in waits if op.message_key() not in run.sent]
    if missing:
        op = missing[0]
        peer = peer_of(run.schedule, op)
        pc = run.pc[peer]
        peer_at = f"step {pc} ({run.program[peer][pc]})" if pc < len(run.program[peer]) else "the end"
        why = f"its {op} needs rank {peer} to send {op.message_key()}, but rank {peer} is stuck at {peer_at}"
    else:
        assert isinstance(step, Action)
        why = f"{step} needs {', '.join(str(a) for a in _local_inputs(run.schedule, rank, step))} first"
    message = f"schedule {run.schedule.name!r} deadlocks: rank {rank} waits forever at step {run.pc[rank]} ({step}): "
    return DeadlockError(message + why, rank, str(step), deadlock_grid(run.program, run.pc))


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    *,
    comm_cost: float = 0.0,
    post_cost: float = 0.0,
    program: Program | None = None,
) -> SimResult:
    """Run ``schedule`` (or an already lowered ``program`` for it) without tensors. ``post_cost``:
    the time each exchange keeps its rank busy posting (exchanges inside an overlapped F&B unit
    are posted around it, free)."""
    check_complete(schedule)
    program = lower(schedule) if program is None else program
    check_program(schedule, program)
    run = _Run(schedule, program, costs, comm_cost, post_cost)
    run.run()
    if run.stuck():
        raise _deadlock(run)
    total = max(run.clock) if run.clock else 0.0
    busy = sum(s.end - s.start for s in run.spans if s.kind != "X")
    bubble = 1.0 - busy / (schedule.num_ranks * total) if total > 0 else 0.0
    timeline = Timeline(schedule.num_ranks, tuple(run.spans), with_stage=schedule.virtual_stages > 1)
    return SimResult(schedule, program, total, bubble, tuple(run.peak), timeline)


__all__ = [
    "DEFAULT_COSTS",
    "SimResult",
    "check_complete",
    "deadlock_grid",
    "format_program",
    "measured_costs",
    "simulate",
]
