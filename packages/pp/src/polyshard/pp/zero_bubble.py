"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2401.10241).

A backward splits into B, the gradient of the stage's input (which the stage
before waits for), and W, the gradient of its weights (which nobody waits
for). Running B as early as possible and W whenever a rank would otherwise
idle removes most of the pipeline's bubble. Both schedules here come from one
list scheduler run on unit costs (F = B = W = 1), tick by tick; at each tick
every idle rank picks, in this order:

1. a ready B, of its later stage first (closest to the loss);
2. else a forward, of its later stage first, if fewer than ``limit`` of its
   (stage, microbatch) activations are in flight (the memory bound);
3. else its oldest deferred W.

Worked example, ZB-V with p=2, m=3 (rank 0 holds stages 0 and 3, rank 1
holds 1 and 2; B is the input half of a backward, W the weight half)::

    rank 0: 0F0 0F1 0F2 3F0 3B0 3F1 3B1 0B0 3W0 0B1 3W1 3F2 3B2 0W0 0W1 0B2 3W2 0W2
    rank 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 1F2 2F2 2W0 1W0 2B2 1B2 2W1 1W1 2W2 1W2
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from polyshard.pp.actions import Action, Kind, Schedule, build_schedule, check_positive, loop_placement, v_placement
from polyshard.pp.errors import ScheduleError

F, BI, W = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's order and memory with the backward split, W's in the bubbles.

    One stage per rank; rank r keeps at most min(p-r, m) microbatches in flight
    (1F1B's bound). Idle time per rank with m >= p: (p-1)(T_F + T_B - T_W) = p-1
    against 1F1B's (p-1)(T_F + T_B + T_W) = 3(p-1): a third (the paper's ZB-H1).
    """
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    return list_schedule("zb-h1", m, loop_placement(p), [min(p - r, m) for r in range(p)])


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V: zero bubble at 1F1B's memory, two stages per rank in a V (rank r holds r and 2p-1-r).

    The paper's figures (T_F = T_B = T_W, m >= 2p-1), which the tests check for every
    p <= 8: each rank computes without a gap from its first action to its last
    (zero bubble; the only idle time is the start-up stagger of (p-1)·T_F, the
    pipeline's "parallelogram", so one step takes 6m + p-1 units of a stage's
    forward), and every rank holds at most 2p (stage, microbatch) activations -
    p microbatches of its whole share of the model, 1F1B's first-stage peak.
    With fewer microbatches it still runs, with a bubble.
    """
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    return list_schedule("zb-v", m, v_placement(p), [2 * p] * p)


def list_schedule(name: str, num_microbatches: int, placement: tuple[int, ...], limit: Sequence[int]) -> Schedule:
    """Greedy zero-bubble schedule on unit costs (see the module docstring); ``limit[r]`` bounds rank r's
    in-flight activations. Every choice respects the dependencies, so the result cannot deadlock."""
    state = _ListState(num_microbatches, placement)
    p = len(state.stages)
    per_rank: list[list[Action]] = [[] for _ in range(p)]
    total = [3 * num_microbatches * len(mine) for mine in state.stages]
    while any(len(per_rank[r]) < total[r] for r in range(p)):
        moved = False
        for r in range(p):
            if per_rank[r] and state.finished[per_rank[r][-1]] > state.tick:
                moved = True  # still busy with its last action
                continue
            action = state.choose(r, limit[r])
            if action is not None:
                per_rank[r].append(action)
                state.run(r, action)
                moved = True
        if not moved:
            raise ScheduleError(f"{name}: the list scheduler is stuck at tick {state.tick} (limits {list(limit)})")
        state.tick += 1
    return build_schedule(name, num_microbatches, per_rank, placement)


class _ListState:
    """What the list scheduler knows at a tick: finish times, next microbatches, deferred W's."""

    def __init__(self, num_microbatches: int, placement: tuple[int, ...]):
        self.m, self.last, self.tick = num_microbatches, len(placement) - 1, 0
        p = max(placement) + 1
        # each rank's stages, the later (closer to the loss) first
        self.stages = [sorted((s for s, r in enumerate(placement) if r == rank), reverse=True) for rank in range(p)]
        self.finished: dict[Action, int] = {}  # action -> tick it ends
        self.next = {(kind, s): 0 for kind in (F, BI) for s in range(len(placement))}  # next microbatch
        self.in_flight = [0] * p  # activations held per rank (F done, B not yet)
        self.deferred: list[deque[Action]] = [deque() for _ in range(p)]  # W's, oldest first

    def done(self, action: Action) -> bool:
        return self.finished.get(action, self.tick + 1) <= self.tick

    def choose(self, rank: int, limit: int) -> Action | None:
        for s in self.stages[rank]:  # a B unblocks the stage before, so it goes first
            k = self.next[(BI, s)]
            grad_ready = s == self.last or self.done(Action(BI, s + 1, k))
            if k < self.m and self.done(Action(F, s, k)) and grad_ready:
                return Action(BI, s, k)
        if self.in_flight[rank] < limit:
            # the later stage first: it reaches the loss (and frees memory) sooner; forwards of the
            # first stage first would fill the memory bound with activations whose B cannot come yet
            for s in self.stages[rank]:
                k = self.next[(F, s)]
                if k < self.m and (s == 0 or self.done(Action(F, s - 1, k))):
                    return Action(F, s, k)
        return self.deferred[rank].popleft() if self.deferred[rank] else None

    def run(self, rank: int, action: Action) -> None:
        self.finished[action] = self.tick + 1
        if action.kind is F:
            self.in_flight[rank] += 1
        elif action.kind is BI:
            self.in_flight[rank] -= 1
            self.deferred[rank].append(Action(W, action.stage, action.microbatch))
        if action.kind is not W:
            self.next[(action.kind, action.stage)] += 1
