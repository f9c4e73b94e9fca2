"""Static checks of a schedule and of its lowered program, before the simulator runs them.

* :func:`check_complete`: every stage runs each microbatch's forward once and
  its backward once (whole, or as an input half and a weight half), on the
  rank the placement gives it; overlapped pairs are adjacent.
* :func:`check_program`: the program runs exactly the schedule's compute
  actions; each receive is posted once, waited for once, before the compute
  that reads it; and between every two ranks the receives are posted in the
  order the sender posts the sends (messages match by order on the wire).
"""

from __future__ import annotations

from collections import Counter

from polyshard.pp.actions import Action, Exchange, Kind, Schedule, Wait
from polyshard.pp.errors import ScheduleError
from polyshard.pp.lowering import Program, peer_of, receives_before

COMPUTE_ORDER = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


def check_complete(schedule: Schedule) -> None:
    """Every stage on a rank runs, per microbatch, one FORWARD and either one BACKWARD or one
    BACKWARD_INPUT and one BACKWARD_WEIGHT (the simulator checks their order)."""
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
    _check_pairs(schedule)


def _check_pairs(schedule: Schedule) -> None:
    for forward, backward in schedule.overlapped:
        actions = schedule.actions[schedule.rank_of(forward.stage)]
        i = actions.index(forward)
        if forward.kind is not Kind.FORWARD or i + 1 >= len(actions) or actions[i + 1] != backward:
            raise ScheduleError(f"overlapped pair ({forward}, {backward}) must be a forward followed by its partner")


def check_program(schedule: Schedule, program: Program) -> None:
    """Raise :class:`ScheduleError` if ``program`` is not a sound lowering of ``schedule``."""
    sent: dict[tuple[int, int], list[Action]] = {}  # (sender, receiver) -> message keys in posting order
    received: dict[tuple[int, int], list[Action]] = {}
    for rank, steps in enumerate(program):
        compute = [s for s in steps if isinstance(s, Action)]
        if tuple(compute) != schedule.actions[rank]:
            raise ScheduleError(f"rank {rank}: the program's compute actions differ from the schedule's")
        posted: set[Action] = set()
        waited: set[Action] = set()
        for step in steps:
            if isinstance(step, Exchange):
                for op in step.ops:
                    book = sent if op.kind.is_send else received
                    pair = (rank, peer_of(schedule, op)) if op.kind.is_send else (peer_of(schedule, op), rank)
                    book.setdefault(pair, []).append(op.message_key())
                    if op.kind.is_recv:
                        if op in posted:
                            raise ScheduleError(f"rank {rank}: {op} is posted twice")
                        posted.add(op)
            elif isinstance(step, Wait):
                for op in step.ops:
                    if op not in posted or op in waited:
                        raise ScheduleError(f"rank {rank}: {step} waits for {op}, not posted or already waited for")
                    waited.add(op)
            elif any(op not in waited for op in receives_before(schedule, rank, step)):
                raise ScheduleError(f"rank {rank}: {step} runs before waiting for its received input")
        if posted - waited:
            never = " ".join(sorted(map(str, posted - waited)))
            raise ScheduleError(f"rank {rank}: receives posted but never waited for: {never}")
    for pair in sent.keys() | received.keys():
        if sent.get(pair, []) != received.get(pair, []):
            raise ScheduleError(
                f"rank {pair[1]} posts its receives from rank {pair[0]} in another order than rank {pair[0]} sends "
                f"({' '.join(map(str, received.get(pair, [])))} against {' '.join(map(str, sent.get(pair, [])))}); "
                "messages between two ranks match in posting order"
            )
