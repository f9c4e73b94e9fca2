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
    return [
        {
            "type": type(w).__name__,
            "is_wrapper": isinstance(w, DataParallelWrapper),  # the Protocol's runtime check
            "callable": callable(w),
            "public": sorted(name for name in dir(w) if not name.startswith("_")),
        }
        for w in wrappers
    ]


def test_both_wrappers_satisfy_the_protocol(distributed):
    declared = {name for name in vars(DataParallelWrapper) if not name.startswith("_")} - {"module"}
    (seen,) = distributed.run(1, _conforming)
    assert [w["type"] for w in seen] == ["DataParallel", "FullyShardedDataParallel"]
    for w in seen:  # runtime check: every member is present
        assert w["is_wrapper"] and w["callable"], w["type"]
        missing = (declared | {"module"}) - set(w["public"])
        assert not missing, (w["type"], missing)
    for cls in (DataParallel, FullyShardedDataParallel):
        for name in declared:  # and each method takes the declared parameters
            ours = list(inspect.signature(getattr(cls, name)).parameters)
            assert ours == list(inspect.signature(getattr(DataParallelWrapper, name)).parameters), (cls, name)
