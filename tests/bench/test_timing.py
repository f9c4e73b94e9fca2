"""The benchmarks' timer: over a group, every rank gets the slowest time; with group=None it issues no
collective, so one rank can time a comparison alone while the others go on (the bench ep hang)."""

import torch
import torch.distributed as dist

from polyshard.bench.timing import time_interleaved


def _noop() -> None:
    pass


def _one_rank_times_alone() -> list[float]:
    # Rank 0 times alone. Had the timer used a barrier or an all-reduce, rank 0's would pair with
    # rank 1's all-reduce below: wrong sums, or both ranks waiting until the pool's timeout.
    if dist.get_rank() == 0:
        time_interleaved(_noop, _noop, group=None, iters=3, warmup=1)
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return [float(total)]


def _every_rank_times_together() -> tuple[float, float]:
    return time_interleaved(_noop, _noop, group=dist.group.WORLD, iters=3, warmup=1)


def test_a_one_process_timing_issues_no_collective(distributed):
    # Each rank's all-reduce meets the other's: 1 + 2 on both.
    assert distributed.run(2, _one_rank_times_alone, timeout_s=60) == [[3.0], [3.0]]


def test_a_group_timing_reports_the_slowest_rank_on_every_rank(distributed):
    first, second = distributed.run(2, _every_rank_times_together, timeout_s=60)
    assert first == second and all(t >= 0 for t in first)  # the all-reduced maximum, the same everywhere
