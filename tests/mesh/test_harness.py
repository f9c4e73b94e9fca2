"""The multi-process harness: failures and hangs fail the test instead of the suite."""

import os
import time

import pytest
import torch.distributed as dist

from polyshard.mesh.testing import WorkerFailure


def _pid_and_rank():
    return os.getpid(), dist.get_rank(), dist.get_world_size()


def _fails_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # rank 0 waits here for rank 1, which never comes


def _hangs():
    time.sleep(60)


def test_workers_are_reused(distributed):
    first = distributed.run(2, _pid_and_rank)
    second = distributed.run(2, _pid_and_rank)
    assert first == second  # same pids: the processes stayed alive
    assert [r[1:] for r in first] == [(0, 2), (1, 2)]


@pytest.mark.long
def test_failure_on_one_rank_shows_its_traceback(distributed):
    with pytest.raises(WorkerFailure) as info:
        distributed.run(2, _fails_on_rank_one, timeout_s=60)
    message = str(info.value)
    assert "rank 1 raised" in message and "ValueError: rank one is unhappy" in message
    assert "did not finish after another rank failed" in message  # rank 0 was stuck in the barrier
    # The next call gets a fresh pool.
    assert [r[1] for r in distributed.run(2, _pid_and_rank)] == [0, 1]


@pytest.mark.long
def test_hang_times_out(distributed):
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"ranks \[0, 1\] did not finish within 2"):
        distributed.run(2, _hangs, timeout_s=2)
    assert time.monotonic() - start < 20
