"""The lowering pass: add the sends, receives and waits a schedule's compute actions imply.

After a compute action comes the send of its output; receives are *posted*
``prefetch`` compute actions before the one that reads them, and *waited for*
just before it, so a message travels while the receiver computes (on gloo a
transfer starts only once both sides have posted). The sends of one action and
the receives posted after it go out as one :class:`Exchange` (one batch of
isend/irecv, like Megatron's ``send_forward_recv_backward``); a :class:`Wait`
blocks on receives only. Posting never blocks, so two neighbours that send to
each other cannot deadlock; a rank only ever waits for data.

Messages between two ranks match in the order they are posted (NCCL has no
tags; gloo matches by order too), so a rank posts its receives from a peer in
the order that peer sends them - if its own compute order needs them in
another order (possible with a V placement), the earlier ones are posted
sooner. Neighbouring stages on the same rank (one rank, the turn of a V,
interleaving with p=1) hand tensors over in memory instead.

Example, 1F1B with p=2, m=2, ``prefetch=1``::

    rank 0: 0F0 [0SF0 0RB0] 0F1 [0SF1 0RB1] (0RB0) 0B0 (0RB1) 0B1
    rank 1: [1RF0] (1RF0) 1F0 [1RF1] 1B0 [1SB0] (1RF1) 1F1 1B1 [1SB1]

``[...]`` posts, ``(...)`` waits. With ``prefetch=0`` each receive is posted in
the exchange right before its wait (the executor does that on backends that
complete a batch as a whole).
"""

from __future__ import annotations

from collections import deque

from polyshard.pp.actions import Action, Exchange, Kind, Schedule, Step, Wait

Program = tuple[tuple[Step, ...], ...]

DEFAULT_PREFETCH = 1
"""Compute actions ahead of their consumer that receives are posted (one: double buffering)."""


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


def receive_of(send: Action) -> Action:
    """The receive on the other side of ``send``."""
    if send.kind is Kind.SEND_FORWARD:
        return Action(Kind.RECV_FORWARD, send.stage + 1, send.microbatch)
    return Action(Kind.RECV_BACKWARD, send.stage - 1, send.microbatch)


def peer_of(schedule: Schedule, op: Action) -> int:
    """The rank on the other side of a send or receive."""
    if op.kind.is_recv:
        return schedule.rank_of(op.message_key().stage)
    return schedule.rank_of(receive_of(op).stage)


def lower(schedule: Schedule, prefetch: int = DEFAULT_PREFETCH) -> Program:
    """Per-rank steps: compute actions with :class:`Exchange` and :class:`Wait` steps in between."""
    # (sender, receiver) -> the receiver's receives, in the order the sender sends
    orders: dict[tuple[int, int], deque[Action]] = {}
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            for send in sends_after(schedule, rank, action):
                orders.setdefault((rank, peer_of(schedule, send)), deque()).append(receive_of(send))
    return tuple(_lower_rank(schedule, rank, orders, prefetch) for rank in range(schedule.num_ranks))


def _lower_rank(
    schedule: Schedule, rank: int, orders: dict[tuple[int, int], deque[Action]], prefetch: int
) -> tuple[Step, ...]:
    actions = schedule.actions[rank]
    needs = [receives_before(schedule, rank, action) for action in actions]
    posted: set[Action] = set()

    def post_through(op: Action) -> list[Action]:
        """``op`` and every receive its sender sends us before it, unless already posted."""
        if op in posted:
            return []
        queue, out = orders[(peer_of(schedule, op), rank)], []
        while op not in posted:
            posted.add(queue[0])
            out.append(queue.popleft())
        return out

    steps: list[Step] = []
    pending: list[Action] = []  # sends of the previous compute action
    for i, action in enumerate(actions):
        posts = [p for needed in needs[i : i + prefetch + 1] for op in needed for p in post_through(op)]
        if pending or posts:
            steps.append(Exchange(tuple(pending + posts)))
        if needs[i]:
            steps.append(Wait(tuple(needs[i])))
        steps.append(action)
        pending = sends_after(schedule, rank, action)
    if pending:
        steps.append(Exchange(tuple(pending)))
    return tuple(steps)


def format_program(program: Program, with_stage: bool = True) -> str:
    return "\n".join(f"rank {r}: " + " ".join(s.short(with_stage) for s in steps) for r, steps in enumerate(program))
