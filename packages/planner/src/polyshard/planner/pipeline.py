"""The pipeline simulator as the planner asks it: cached, and extrapolated for long steps.

In-flight microbatches (what activation memory multiplies by) and the step's length (bubbles
included) come from :func:`polyshard.pp.simulate` on the real schedule, never from a table. A
schedule with many microbatches is simulated at two lengths ``m1 < m2`` whose difference is a
multiple of the pipeline ranks, and the figures are continued in a straight line: every schedule
here repeats the same steady-state pattern per microbatch once its warm-up is over, so peak
in-flight counts and the step's length are linear in m beyond it (GPipe's peak is m itself).

The search screens many layouts with :func:`unit_run` (F = B = W = 1, cached per schedule shape,
scaled by the layout's slowest stage) and simulates the best of them with their own costs
(:func:`step_time`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from polyshard.pp import Action, Kind, make_schedule, simulate

MAX_SIMULATED = 16
"""Simulate at most this many microbatches (or 2 x ranks x stages per rank, past any warm-up, if
more); extrapolate beyond."""


@dataclass(frozen=True)
class PipelineCosts:
    """Seconds per action on each stage: forward, input-backward, weight-backward; and the
    point-to-point transfer of one microbatch's activation (or its gradient) between stages."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    p2p: float = 0.0

    def of(self, action: Action) -> float:
        """Seconds ``action`` takes; a backward that is not split into input and weight halves is both."""
        stage = action.stage
        if action.kind is Kind.FORWARD:
            return self.forward[stage]
        if action.kind is Kind.BACKWARD:
            return self.backward[stage] + self.weight[stage]
        if action.kind is Kind.BACKWARD_INPUT:
            return self.backward[stage]
        return self.weight[stage]


def _lengths(num_ranks: int, num_microbatches: int, virtual_stages: int) -> tuple[int, int] | None:
    """(m1, m2) to simulate instead of ``num_microbatches``, or None to simulate it as it is."""
    step, interleaved = num_ranks, virtual_stages > 1
    cap = max(MAX_SIMULATED, 2 * num_ranks * virtual_stages + num_ranks)
    if num_microbatches <= cap:
        return None
    m2 = cap - cap % step if interleaved else cap
    return m2 - step, m2


def _extrapolate(m1: int, m2: int, m: int, y1: float, y2: float) -> float:
    return y1 + (y2 - y1) * (m - m1) / (m2 - m1)


@lru_cache(maxsize=256)
def stages_by_rank(schedule: str, num_ranks: int, virtual_stages: int = 1) -> tuple[tuple[int, ...], ...]:
    """The pipeline stages each rank holds. Placement is data in a schedule and does not depend on the
    number of microbatches, so a short schedule answers for any."""
    placed = make_schedule(schedule, num_ranks, 2 * num_ranks, virtual_stages)  # dualpipev needs m >= 2p
    return tuple(tuple(placed.stages_of(rank)) for rank in range(num_ranks))


@lru_cache(maxsize=1024)
def unit_run(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[float, tuple[int, ...]]:
    """(step length, peak in-flight per rank) with F = B = W = 1 and free transfers."""

    def run(m: int) -> tuple[float, tuple[int, ...]]:
        result = simulate(make_schedule(schedule, num_ranks, m, virtual_stages))
        return result.total_time, result.peak_activations

    lengths = _lengths(num_ranks, num_microbatches, virtual_stages)
    if lengths is None:
        return run(num_microbatches)
    m1, m2 = lengths
    (t1, low), (t2, high) = run(m1), run(m2)
    peaks = tuple(round(_extrapolate(m1, m2, num_microbatches, a, b)) for a, b in zip(low, high))
    return _extrapolate(m1, m2, num_microbatches, t1, t2), peaks


def peak_in_flight(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Per pipeline rank, the most (stage, microbatch) pairs whose forward ran and backward has not."""
    return unit_run(schedule, num_ranks, num_microbatches, virtual_stages)[1]


def step_time(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int, costs: PipelineCosts, exact: bool = True
) -> float:
    """Seconds from the first forward to the last backward, bubbles and transfers included. Not
    ``exact``: the unit-cost step scaled by the slowest stage's F + B + W, plus one transfer each way
    per boundary (a screen for ranking many layouts)."""
    if not exact:
        slowest = max(f + b + w for f, b, w in zip(costs.forward, costs.backward, costs.weight))
        unit = unit_run(schedule, num_ranks, num_microbatches, virtual_stages)[0]
        return unit * slowest / 3 + 2 * (num_ranks - 1) * costs.p2p

    def run(m: int) -> float:
        return simulate(make_schedule(schedule, num_ranks, m, virtual_stages), costs.of, comm_cost=costs.p2p).total_time

    lengths = _lengths(num_ranks, num_microbatches, virtual_stages)
    if lengths is None:
        return run(num_microbatches)
    m1, m2 = lengths
    return _extrapolate(m1, m2, num_microbatches, run(m1), run(m2))
