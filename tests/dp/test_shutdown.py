"""Nothing of a wrapper outlives the job's process group.

A 3-rank job (stages 0-3 on one group, AdamW steps, then ``destroy_process_group``) aborted at exit once
in five runs: the wrappers could never be freed (their gradient hooks live on the parameters' C++ side,
out of the garbage collector's sight) and the flight recorder kept the groups of its last calls, so the
process group, and gloo's threads with it, outlived ``destroy_process_group`` into the interpreter's
exit. Here each wrapper trains on a group of its own; once the wrapper is dropped and the group
destroyed, the group must be gone.
"""

import gc
import weakref

import torch.distributed as dist

from polyshard.dp import DataParallel, FullyShardedDataParallel, ZeroOptimizer

from ._helpers import adamw, local_step_loss, make_model

STEPS = 6  # as in the job that aborted


def _in_flight(model) -> int:
    """Collectives this wrapper posted and has not waited for."""
    if isinstance(model, FullyShardedDataParallel):
        return sum((u._gather is not None) + (u._reduce is not None) for u in model.reduce_order)
    return sum(b.work is not None for b in model.buckets())


def _train_then_destroy(stage: int):
    group = dist.new_group(list(range(dist.get_world_size())))
    if stage == 3:
        model = FullyShardedDataParallel(make_model(), group=group)
    else:
        model = DataParallel(make_model(), group=group, zero_stage=stage)
    opt = ZeroOptimizer(adamw(model.parameters()), model)
    for step in range(STEPS):
        local_step_loss(model, step, 1, group)
        opt.step()
        opt.zero_grad()
    in_flight = _in_flight(model)
    group_ref = weakref.ref(group)
    del model, opt, group
    dist.destroy_process_group(group_ref())
    gc.collect()  # ZeRO-3's forward hooks form an ordinary reference cycle, which only the collector frees
    return in_flight, group_ref() is None


def _all_stages():
    return {stage: _train_then_destroy(stage) for stage in range(4)}


def test_nothing_in_flight_and_the_group_is_freed_when_destroyed(distributed):
    for rank, seen in enumerate(distributed.run(3, _all_stages)):
        for stage, (in_flight, freed) in seen.items():
            assert in_flight == 0, (rank, stage)
            assert freed, f"rank {rank}: the stage-{stage} wrapper's group outlived destroy_process_group"
