"""The lowering pass: add the sends and receives a schedule's compute actions imply.

Before a compute action come the receives of its inputs from another rank;
after it, the send of its output. The sends of one action and the receives
of the next are merged into one :class:`Exchange`, which the executor posts
as a single batch of isend/irecv (Megatron's ``send_forward_recv_backward``).
Two neighbours that each send to and receive from the other in the same
batch therefore cannot deadlock. Neighbouring stages on the same rank (one
rank, or interleaving with p=1) hand tensors over in memory instead.

Example, 1F1B with p=2, m=2, rank 0::

    0F0 [0SF0] 0F1 [0SF1 0RB0] 0B0 [0RB1] 0B1
"""

from __future__ import annotations

from polyshard.pp.actions import Action, Exchange, Kind, Schedule, Step

Program = tuple[tuple[Step, ...], ...]


def receives_before(schedule: Schedule, rank: int, action: Action) -> list[Action]:
    s, k, last = action.stage, action.microbatch, schedule.num_stages - 1
    if action.kind is Kind.FORWARD and s > 0 and schedule.rank_of(s - 1) != rank:
        return [Action(Kind.RECV_FORWARD, s, k)]
    if action.kind.ends_activation and s < last and schedule.rank_of(s + 1) != rank:
        return [Action(Kind.RECV_BACKWARD, s, k)]
    return []


def sends_after(schedule: Schedule, rank: int, action: Action) -> list[Action]:
    s, k, last = action.stage, action.microbatch, schedule.num_stages - 1
    if action.kind is Kind.FORWARD and s < last and schedule.rank_of(s + 1) != rank:
        return [Action(Kind.SEND_FORWARD, s, k)]
    if action.kind.ends_activation and s > 0 and schedule.rank_of(s - 1) != rank:
        return [Action(Kind.SEND_BACKWARD, s, k)]
    return []


def lower(schedule: Schedule) -> Program:
    """Per-rank steps: compute actions with :class:`Exchange` steps in between."""
    program = []
    for rank, actions in enumerate(schedule.actions):
        steps: list[Step] = []
        pending: list[Action] = []
        for action in actions:
            ops = pending + receives_before(schedule, rank, action)
            if ops:
                steps.append(Exchange(tuple(ops)))
            steps.append(action)
            pending = sends_after(schedule, rank, action)
        if pending:
            steps.append(Exchange(tuple(pending)))
        program.append(tuple(steps))
    return tuple(program)


def format_program(program: Program, with_stage: bool = True) -> str:
    return "\n".join(f"rank {r}: " + " ".join(s.short(with_stage) for s in steps) for r, steps in enumerate(program))
