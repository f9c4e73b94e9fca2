"""Pipeline schedules as pure functions: (p ranks, m microbatches, ...) -> per-rank actions.

Worked example, p=2, m=4 (F=forward, B=backward of microbatch k)::

    gpipe        rank 0: F0 F1 F2 F3 B0 B1 B2 B3
                 rank 1: F0 F1 F2 F3 B0 B1 B2 B3
    1f1b         rank 0: F0 F1 B0 F2 B1 F3 B2 B3
                 rank 1: F0 B0 F1 B1 F2 B2 F3 B3

GPipe (Huang et al. 1811.06965) keeps all m microbatches' activations; 1F1B
(PipeDream-Flush, Narayanan et al. 2006.09668) starts backwards as soon as
possible so stage s holds at most p-s. Interleaved 1F1B (Megatron-LM
2104.04473) gives every rank v model chunks to shrink the bubble by v.
ZB-H1 (Qi et al. 2401.10241) splits backward into B (input gradient) and
W (weight gradient) and runs the W's in what would be bubbles; ZB-V does the
same with two stages per rank in a V (:mod:`polyshard.pp.zero_bubble`).
DualPipeV (DeepSeek-V3) pairs a forward of one V stage with a backward of the
other (:mod:`polyshard.pp.dualpipe`).
"""

from __future__ import annotations

from collections.abc import Callable

from polyshard.pp.actions import Action, Kind, Schedule, build_schedule, check_positive, loop_placement
from polyshard.pp.dualpipe import dualpipe_v
from polyshard.pp.errors import ScheduleError
from polyshard.pp.zero_bubble import zb_h1, zb_v

F, B = Kind.FORWARD, Kind.BACKWARD


def _make(name: str, p: int, m: int, v: int, per_rank: list[list[Action]]) -> Schedule:
    return build_schedule(name, m, per_rank, loop_placement(p, v))


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (in the same microbatch order)."""
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    per_rank = [[Action(F, r, k) for k in range(m)] + [Action(B, r, k) for k in range(m)] for r in range(p)]
    return _make("gpipe", p, m, 1, per_rank)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Warm up with p-r-1 forwards, then alternate one forward and one backward, then drain."""
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    per_rank = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [Action(F, r, k) for k in range(warmup)]
        for i in range(m - warmup):
            actions += [Action(F, r, warmup + i), Action(B, r, i)]
        actions += [Action(B, r, k) for k in range(m - warmup, m)]
        per_rank.append(actions)
    return _make("1f1b", p, m, 1, per_rank)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: rank r runs stages r, r+p, ..., r+(v-1)p.

    Microbatches go through the chunks in groups of p: forward slot k is chunk
    (k // p) % v of microbatch (k // (p*v))*p + k % p; backward slots visit the
    chunks in reverse. Rank r warms up with 2(p-r-1) + (v-1)p forwards.
    """
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches, virtual_stages=virtual_stages)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if m % p:
        choices = ", ".join(str(p * i) for i in range(1, 4))
        raise ScheduleError(
            f"interleaved 1F1B needs num_microbatches to be a multiple of the pipeline ranks num_ranks={p}, got {m}; "
            f"choose num_microbatches in {{{choices}, ...}}"
        )
    total = m * v

    def slot(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    per_rank = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        fwd = [Action(F, c * p + r, k) for c, k in (slot(i, True) for i in range(total))]
        bwd = [Action(B, c * p + r, k) for c, k in (slot(i, False) for i in range(total))]
        actions = fwd[:warmup]
        for i in range(total - warmup):
            actions += [fwd[warmup + i], bwd[i]]
        actions += bwd[total - warmup :]
        per_rank.append(actions)
    return _make("interleaved", p, m, v, per_rank)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "dualpipev": dualpipe_v,
}

STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "zb-v": 2, "dualpipev": 2}
"""Stages each rank holds, for the schedules that fix it (interleaved takes any virtual_stages)."""


def forward_only(schedule: Schedule) -> Schedule:
    """The forward-only program of ``schedule``: the same stages on the same ranks, each run once
    on the whole batch (one microbatch: nothing is kept for a backward, so nothing to interleave).
    Evaluation and inference run this; it is deadlock-free for any placement (stages run in order)."""
    per_rank = [[Action(F, stage, 0) for stage in schedule.stages_of(r)] for r in range(schedule.num_ranks)]
    return build_schedule(f"{schedule.name} (forward only)", 1, per_rank, schedule.placement)


def make_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None) -> Schedule:
    """Look a schedule up by name. ``virtual_stages`` (stages per rank) defaults to what the schedule
    needs: 2 for ``interleaved`` (which takes any v >= 1), 1 for the others, which accept only that."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_1f1b(num_ranks, num_microbatches, 2 if virtual_stages is None else virtual_stages)
    needed = STAGES_PER_RANK[name]
    if virtual_stages is not None and virtual_stages != needed:
        raise ScheduleError(
            f"schedule {name!r} puts {needed} stage(s) on each rank, not virtual_stages={virtual_stages}; "
            f"set virtual_stages={needed}" + (" or use 'interleaved'" if needed == 1 else "")
        )
    return SCHEDULES[name](num_ranks, num_microbatches)
