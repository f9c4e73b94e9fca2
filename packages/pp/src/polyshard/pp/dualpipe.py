"""DualPipeV: DeepSeek-V3's DualPipe (2412.19437) in its V-shaped, single-direction form.

DualPipe feeds microbatches into both ends of the pipeline at once, so every
rank holds two copies of the model's stages. Cutting it in half (Sea AI Lab's
"cut-in-half", as DeepSeek's DualPipe repository describes DualPipeV) keeps
one direction on half the ranks: p ranks, 2p stages in a V (rank r holds
stages r and 2p-1-r, rank 0 the first and the last). In the steady state a
rank runs a forward of one of its stages next to a full backward of the other
("F&B"), which DualPipe overlaps so one's communication hides behind the
other's compute; here they run one after the other, and the pair is recorded
in ``Schedule.overlapped`` so the simulator can cost it as one unit.

Rank r's program, with ``a`` its first stage (r), ``b`` its second (2p-1-r),
``B`` a full backward, ``Bi``/``W`` the zero-bubble halves of one, and each
W the oldest deferred one::

    2(p-r-1) x  Fa                                   warm up the first stage
       r+1   x  Fa Fb                                reach the turn of the V
     p-r-1   x  Bib W Fb                             first backwards of b, W at once
    m-2p+r+1 x  (Fa&Bb) (Fb&Ba)                      steady state: two F&B pairs
     p-r-1   x  Bb (Fb&Ba)                           forwards run out
       r+1   x  Bb Ba                                the last r+1 of these 2(r+1) split
     p-r-1   x  W Bia                                deferred W's fill the gaps
       r+1   x  W

(on rank p-1 the first ``Fa Bb`` of the steady state runs as two actions: the
pair's forward feeds its own backward through the turn). DeepSeek's figures
for PP = 2p stages, which the tests check: peak activations PP+1 = 2p+1
(stage, microbatch) pairs per rank, and with T_F = T_B = T_W (a full backward
2T_B) the bubble (PP/2-1)(T_F&B + T_fullB - 3T_W) = (p-1)(T_F&B - 1) when each
F&B pair runs as one unit of cost T_F&B.
"""

from __future__ import annotations

from polyshard.pp.actions import Action, Kind, Schedule, check_positive, v_placement
from polyshard.pp.errors import ScheduleError


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV on p ranks (2p stages in a V) with m >= 2p microbatches."""
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        raise ScheduleError(
            f"dualpipev needs at least 2 x num_ranks = {2 * p} microbatches to fill its V, got {m}; "
            f"choose num_microbatches >= {2 * p}"
        )
    programs = [_RankProgram(p, r) for r in range(p)]
    for rank in programs:
        rank.phases(m)
    placement = v_placement(p)
    actions = tuple(tuple(rank.actions) for rank in programs)
    pairs = frozenset(pair for rank in programs for pair in rank.pairs)
    return Schedule("dualpipev", p, m, 2, actions, placement, overlapped=pairs)


class _RankProgram:
    """Rank r's actions, written phase by phase (see the module docstring)."""

    def __init__(self, p: int, r: int):
        self.p, self.r = p, r
        self.a, self.b = r, 2 * p - 1 - r  # first and second stage of the V
        self.actions: list[Action] = []
        self.pairs: list[tuple[Action, Action]] = []
        self.next_forward = {self.a: 0, self.b: 0}
        self.next_backward = {self.a: 0, self.b: 0}
        self.deferred: list[Action] = []  # W's, oldest first

    def phases(self, m: int) -> None:
        p, r, a, b = self.p, self.r, self.a, self.b
        for _ in range(2 * (p - r - 1)):
            self.forward(a)
        for _ in range(r + 1):
            self.forward(a)
            self.forward(b)
        for _ in range(p - r - 1):
            self.backward(b, split=True)
            self.weight()
            self.forward(b)
        for i in range(m - 2 * p + r + 1):
            self.pair(a, b, overlapped=not (i == 0 and r == p - 1))
            self.pair(b, a)
        for _ in range(p - r - 1):
            self.backward(b)
            self.pair(b, a)
        for i in range(2 * (r + 1)):  # alternately b and a; the second half splits off its W's
            self.backward(b if i % 2 == 0 else a, split=i >= r + 1)
        for _ in range(p - r - 1):
            self.weight()
            self.backward(a, split=True)
        for _ in range(r + 1):
            self.weight()

    def forward(self, stage: int) -> Action:
        action = Action(Kind.FORWARD, stage, self.next_forward[stage])
        self.next_forward[stage] += 1
        self.actions.append(action)
        return action

    def backward(self, stage: int, split: bool = False) -> Action:
        k = self.next_backward[stage]
        self.next_backward[stage] += 1
        action = Action(Kind.BACKWARD_INPUT if split else Kind.BACKWARD, stage, k)
        if split:
            self.deferred.append(Action(Kind.BACKWARD_WEIGHT, stage, k))
        self.actions.append(action)
        return action

    def weight(self) -> None:
        self.actions.append(self.deferred.pop(0))

    def pair(self, forward_stage: int, backward_stage: int, overlapped: bool = True) -> None:
        """A forward of one stage and a full backward of the other: DualPipe's overlapped F&B."""
        forward = self.forward(forward_stage)
        backward = self.backward(backward_stage)
        if overlapped:
            self.pairs.append((forward, backward))
