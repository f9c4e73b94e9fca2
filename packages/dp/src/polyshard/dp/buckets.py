"""Gradient buckets: parameters whose gradients travel together in one collective.

Buckets follow *reverse registration order*: backward produces the last
layer's gradients first, so the first bucket fills (and its reduction starts)
while the rest of backward still runs (Li et al., "PyTorch Distributed",
2006.15704, section 3.2.3). Buckets of one group are launched strictly in
index order, so every rank issues the same collectives in the same order even
when some parameter got no gradient on some rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import ops
from polyshard.dp.flat import FlatLayout, GradBuffer, shares_storage


def assign_buckets(params: Sequence[nn.Parameter], cap_bytes: int) -> list[list[int]]:
    """Indices of ``params`` grouped into buckets of at most ``cap_bytes`` (a larger param gets its own).

    Walks the list backwards: ``assign_buckets([a, b, c], cap)`` puts ``c`` in bucket 0.
    """
    buckets: list[list[int]] = [[]]
    size = 0
    for index in reversed(range(len(params))):
        nbytes = params[index].numel() * params[index].element_size()
        if buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += nbytes
    return [b for b in buckets if b]


class Bucket:
    """One bucket's gradients: packed into a flat buffer, reduced asynchronously, then read back.

    ``stage`` 0 all-reduces the whole buffer (every rank keeps every gradient);
    stages 1 and 2 reduce-scatter it, so each rank gets the sum of its own
    rows (see :mod:`polyshard.dp.flat`). Stage 1 keeps the full buffer
    between steps (ZeRO-1 holds full gradients); stage 2 drops it after the
    reduction and keeps only the shard. With a ``replicate_group`` (hybrid
    sharding) the reduce-scattered shard is then all-reduced across it, so it
    sums every replica's gradients too (``divide_by`` counts both groups).

    A bucket with nothing to reduce (a group of one rank, no replicas: the data-parallel wrapper of
    a pipeline or tensor-parallel layout without dp) whose gradients are already in the reduce dtype
    is *solo*: it packs nothing and leaves each gradient where autograd put it (``p.grad``), only
    dividing it by ``divide_by`` when that is not 1. Packing would copy every gradient into a flat
    buffer, all-reduce it over the one rank and read it back, per step (the composed pp2 row of
    ``polyshard bench peers``: 136 parameters, ~2.6 ms of a 83 ms step; ``polyshard.bench.pprof``).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        names: Iterable[str],
        *,
        group: dist.ProcessGroup,
        stage: int,
        reduce_dtype: torch.dtype,
        divide_by: int,
        replicate_group: dist.ProcessGroup | None = None,
    ):
        self.params, self.names = list(params), list(names)
        self.group, self.stage, self.divide_by = group, stage, divide_by
        self.replicate_group = replicate_group
        self.reduce_dtype = reduce_dtype
        self.rank = dist.get_rank(group)
        n = 1 if stage == 0 else dist.get_world_size(group)
        self.layout = FlatLayout([tuple(p.shape) for p in self.params], n)
        self.ready: set[int] = set()  # indices whose gradient is final for this step
        self.buffer: GradBuffer | None = None  # every gradient (and presence flags), reduce dtype
        self.reduced: torch.Tensor | None = None  # (layout.shard_numel,) this rank's reduced rows (all at stage 0)
        self._landing: torch.Tensor | None = None  # where the in-flight reduction writes (flags included)
        self.present: list[bool] = [False] * len(self.params)  # did any rank produce each gradient
        self.work: Any = None  # the in-flight reduction's handle
        self.launched = False
        self.solo = (
            dist.get_world_size(group) == 1
            and replicate_group is None
            and all(p.dtype == reduce_dtype for p in self.params)
        )

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def launch(self) -> None:
        """Pack the gradients (missing ones count as zeros, and are flagged so) and start the reduction."""
        self.launched = True
        if self.solo:  # nothing to reduce: the gradients stay in p.grad (see the class docstring)
            return
        device = self.params[0].device
        if self.buffer is None:
            self.buffer = GradBuffer(self.layout, self.reduce_dtype, device)
        self.buffer.pack([p.grad for p in self.params])
        for p in self.params:
            p.grad = None  # the buffer holds them now; drop autograd's copies
        if self.stage == 0:
            self._landing = self.buffer.data
            self.work = ops.all_reduce(self.buffer.data, self.group, async_op=True)
        else:  # the buffer's other rows are not read again this step: the reduction may overwrite them
            self._landing, self.work = ops.reduce_scatter_flat_in_place(self.buffer.data, self.group, async_op=True)

    def wait(self) -> None:
        """Finish the reduction and turn the sum into the average; a gradient no rank produced stays None."""
        if self.solo:
            self.present = [p.grad is not None for p in self.params]
            held = [p.grad for p in self.params if p.grad is not None]
            if self.divide_by != 1 and held:
                torch._foreach_div_(held, float(self.divide_by))
            return
        buffer = cast(GradBuffer, self.buffer)  # launch() made it
        cast(Any, self.work).wait()
        self.work = None
        if self.replicate_group is not None:
            # Hybrid sharding: the shard (presence flags included) sums over the other replicas' shards.
            ops.all_reduce(cast(torch.Tensor, self._landing), self.replicate_group)
        landing = cast(torch.Tensor, self._landing)
        if self.stage == 2 and shares_storage(landing, buffer.data):
            landing = landing.clone()  # stage 2 frees the buffer below: its row (a view of it on gloo) moves out
        grads, self.present = buffer.split(landing)
        self._landing = None
        grads.div_(self.divide_by)
        if self.stage == 0:
            self.reduced = grads
            for index, p in enumerate(self.params):
                if p.dtype == self.reduce_dtype and self.present[index]:  # a view of the bucket, as DDP does
                    p.grad = self.layout.unpack(grads, index)
            return
        if self.stage == 1:
            # Keep only the full buffer: this rank's rows of it become the reduced shard (on gloo the
            # reduction already left them there, see reduce_scatter_flat_in_place).
            mine = buffer.grid[self.rank]
            if grads.data_ptr() != mine.data_ptr():
                mine.copy_(grads)
            self.reduced = mine
        else:
            self.reduced = grads
            self.buffer = None

    def grad_shard(self, index: int) -> torch.Tensor | None:
        """This rank's reduced, averaged rows of parameter ``index`` (the whole gradient at stage 0);
        None when no rank produced a gradient for it this step."""
        if self.solo:
            grad = self.params[index].grad if self.present[index] else None
            return grad if grad is None or self.stage == 0 else grad.view(self.layout.specs[index].shard_shape)
        if self.reduced is None or not self.present[index]:
            return None
        if self.stage == 0:
            return self.layout.unpack(self.reduced, index)
        return self.layout.shard_view(self.reduced, index)

    def drop_grads(self) -> None:
        """After the optimizer step: stage 2 frees its shard (stages 0/1 reuse the buffer next step)."""
        self.present = [False] * len(self.params)
        if self.stage == 2:
            self.reduced = None

    def tensors(self) -> list[torch.Tensor]:
        """The gradient memory this bucket holds now (for memory accounting)."""
        held = [] if self.buffer is None else [self.buffer.data]
        return held + ([self.reduced] if self.reduced is not None and self.stage == 2 else [])
