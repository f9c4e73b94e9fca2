"""The pipeline simulator as the planner asks it: cached, and extrapolated for long steps.

In-flight microbatches (what activation memory multiplies by) and the step's length (bubbles
included) come from :func:`polyshard.pp.simulate` on the real schedule, never from a table. A
schedule with many microbatches is simulated at two lengths ``m1 < m2`` whose difference is a
multiple of the pipeline ranks, and the figures are continued in a straight line: every schedule
here repeats the same steady-state pattern per microbatch once its warm-up is over, so peak
in-flight counts and the step's length are linear in m beyond it (GPipe's peak is m itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from polyshard.pp import Action, make_schedule, simulate

MAX_SIMULATED = 48
"""Simulate at most this many microbatches (or 4 x the ranks, if more); extrapolate beyond."""


@dataclass(frozen=True)
class PipelineCosts:
    """Seconds per action on each stage: forward, input-backward, weight-backward; and the
    point-to-point transfer of one microbatch's activation (or its gradient) between stages."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    p2p: float = 0.0

    def of(self, action: Action) -> float:
        return {"F": self.forward, "B": self.backward, "W": self.weight}[action.kind][action.stage]


def _lengths(num_ranks: int, num_microbatches: int, interleaved: bool) -> tuple[int, int] | None:
    """(m1, m2) to simulate instead of ``num_microbatches``, or None to simulate it as it is."""
    step = num_ranks
    cap = max(MAX_SIMULATED, 4 * num_ranks)
    if num_microbatches <= cap:
        return None
    m2 = cap - cap % step if interleaved else cap
    return m2 - step, m2


def _extrapolate(m1: int, m2: int, m: int, y1: float, y2: float) -> float:
    return y1 + (y2 - y1) * (m - m1) / (m2 - m1)


@lru_cache(maxsize=1024)
def peak_in_flight(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Per pipeline rank, the most (stage, microbatch) pairs whose forward ran and backward has not."""
    lengths = _lengths(num_ranks, num_microbatches, schedule == "interleaved")
    if lengths is None:
        return simulate(make_schedule(schedule, num_ranks, num_microbatches, virtual_stages)).peak_activations
    m1, m2 = lengths
    low = simulate(make_schedule(schedule, num_ranks, m1, virtual_stages)).peak_activations
    high = simulate(make_schedule(schedule, num_ranks, m2, virtual_stages)).peak_activations
    return tuple(round(_extrapolate(m1, m2, num_microbatches, a, b)) for a, b in zip(low, high))


def step_time(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int, costs: PipelineCosts) -> float:
    """Seconds from the first forward to the last backward, bubbles and transfers included."""

    def run(m: int) -> float:
        return simulate(make_schedule(schedule, num_ranks, m, virtual_stages), costs.of, comm_cost=costs.p2p).total_time

    lengths = _lengths(num_ranks, num_microbatches, schedule == "interleaved")
    if lengths is None:
        return run(num_microbatches)
    m1, m2 = lengths
    return _extrapolate(m1, m2, num_microbatches, run(m1), run(m2))
