"""Both data-parallel wrappers offer the one declared interface, with the same signatures."""

import inspect

import torch.distributed as dist
from torch import nn

from polyshard.dp import DataParallel, DataParallelWrapper, FullyShardedDataParallel


def _conforming():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    wrappers = [
        DataParallel(model, group=dist.group.WORLD, zero_stage=1),
        FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4)), group=dist.group.WORLD),
    ]
    return [isinstance(w, DataParallelWrapper) for w in wrappers]


def test_both_wrappers_satisfy_the_protocol(distributed):
    assert distributed.run(1, _conforming) == [[True, True]]  # runtime check: every member is present
    declared = {name for name in vars(DataParallelWrapper) if not name.startswith("_")} - {"module"}
    for cls in (DataParallel, FullyShardedDataParallel):
        for name in declared:  # and each method takes the declared parameters
            ours = list(inspect.signature(getattr(cls, name)).parameters)
            assert ours == list(inspect.signature(getattr(DataParallelWrapper, name)).parameters), (cls, name)
