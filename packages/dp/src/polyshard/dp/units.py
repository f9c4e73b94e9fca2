"""A ZeRO-3 unit: one block's parameters, sharded at rest and gathered around its use.

At rest each rank holds only ``local`` (its rows of every parameter, see
:mod:`polyshard.dp.flat`) and the parameters' storages are resized to zero
bytes. ``gather`` all-gathers the rows and refills the storages in place, so
tensors that autograd saved in forward see the values again in backward.
``launch_reduce`` reduce-scatters the block's gradients and frees it. With a
``replicate_group`` (hybrid sharding) ``wait_reduce`` then all-reduces the
shard across the replicas; gathers stay inside ``group``. A frozen unit
(``trainable=False``, LoRA's base) only gathers and frees: no master, no
reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist

from polyshard.collectives import ops
from polyshard.dp.flat import FlatLayout, GradBuffer, master_rows, shard_record, shares_storage, write_rows
from polyshard.mesh import Replicate, TensorPlacement, get_placement, set_placement


class Unit:
    """Parameters of one block (or the root's leftovers) on one dp group."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        *,
        group: dist.ProcessGroup,
        dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        axis: str | tuple[str, ...],
        replicate_group: dist.ProcessGroup | None = None,
        replicate_axis: str | tuple[str, ...] | None = None,
        trainable: bool = True,
    ):
        self.trainable = trainable  # False: frozen parameters (LoRA's base), gathered but never reduced
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group, self.reduce_dtype, self.replicate_group = group, reduce_dtype, replicate_group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.layout = FlatLayout([tuple(p.shape) for p in self.params], self.n)
        self.local = torch.empty(self.layout.shard_numel, dtype=dtype, device=self.params[0].device)
        self.master_init: dict[int, torch.Tensor] = {}
        self.local_views = []  # this rank's rows of each parameter, with placement records
        for index, (name, p) in enumerate(named_params):
            if replicate_axis is not None:  # every replica holds these rows: record it (outer axes first)
                record = get_placement(p) or TensorPlacement(name, tuple(p.shape))
                for a in (replicate_axis,) if isinstance(replicate_axis, str) else replicate_axis:
                    record = record.with_axis(a, Replicate())
                set_placement(p, record)
            spec = self.layout.specs[index]
            full = p.detach()
            view = self.layout.shard_view(self.local, index)
            view.copy_(spec.shard_of(full, self.rank))
            self.local_views.append(set_placement(view, shard_record(get_placement(p), name, spec, axis)))
            if trainable:  # without mixed precision the fp32 local rows are the optimizer's master: no copy
                self.master_init[id(p)] = master_rows(dtype, view.detach, full, spec, self.rank)
            p.data = torch.empty(p.shape, dtype=dtype, device=p.device)  # own storage, freed below
        self.gathered = True
        self.free()
        self._gather: tuple[Any, torch.Tensor] | None = None  # (work, buffer) of an in-flight all-gather
        # (work, input, output) of an in-flight reduce-scatter
        self._reduce: tuple[Any, GradBuffer, torch.Tensor] | None = None
        self.ready: set[int] = set()
        self.launched = False
        self.grad_shard: torch.Tensor | None = None  # (shard_numel,) averaged, summed over backwards
        self.present = [False] * len(self.params)  # did any rank produce each gradient this step
        # Kept gathered after forward (FullyShardedDataParallel's keep_gathered): the forwards whose
        # backward has not yet reduced this unit's gradients; it is freed when none is left.
        self.keep = False
        self.awaiting_backward = 0

    # -- parameters ---------------------------------------------------------------
    def start_gather(self) -> None:
        """Begin the all-gather (used to prefetch the next block while this one computes)."""
        if self.gathered or self._gather is not None:
            return
        buffer = torch.empty(self.layout.numel, dtype=self.local.dtype, device=self.local.device)
        self._gather = (ops.all_gather_flat(buffer, self.local, self.group, async_op=True), buffer)

    def drop_prefetch(self) -> None:
        """Finish and discard an all-gather nobody used (its block was skipped), so a later
        gather reads this rank's rows as they are then, not as they were before an optimizer step."""
        if self._gather is not None:
            self._gather[0].wait()
            self._gather = None

    def gather(self) -> None:
        """Make every parameter hold its full value (waits for a prefetch if one is in flight)."""
        if self.gathered:
            return
        self.start_gather()
        work, buffer = cast(tuple[Any, torch.Tensor], self._gather)  # start_gather just posted it
        work.wait()
        self._gather = None
        with torch.no_grad():
            for index, p in enumerate(self.params):
                p.untyped_storage().resize_(p.numel() * p.element_size())
                p.data.copy_(self.layout.unpack(buffer, index))
        self.gathered = True

    def free(self) -> None:
        """Release the full parameters; only ``local`` stays."""
        if not self.gathered:
            return
        for p in self.params:
            p.untyped_storage().resize_(0)
        self.gathered = False

    def write_local(self, values: Mapping[int, torch.Tensor]) -> None:
        """Set this rank's rows from optimizer results (keyed by ``id(param)``); no communication."""
        with torch.no_grad():
            for view, p in zip(self.local_views, self.params):
                write_rows(view, values[id(p)])  # nothing to copy when the master is the view

    # -- gradients ------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def launch_reduce(self) -> None:
        """Reduce-scatter this backward's gradients (missing ones are zeros, flagged so), then free the block."""
        buffer = GradBuffer(self.layout, self.reduce_dtype, self.local.device)
        buffer.pack([p.grad for p in self.params])
        for p in self.params:
            p.grad = None
        out, work = ops.reduce_scatter_flat_in_place(buffer.data, self.group, async_op=True)
        self._reduce = (work, buffer, out)
        self.launched = True
        if self.awaiting_backward:
            self.awaiting_backward -= 1
        if not self.awaiting_backward:
            self.free()

    def wait_reduce(self) -> None:
        """Finish the reduce-scatter and add the average into ``grad_shard`` (gradient accumulation)."""
        work, buffer, out = cast(tuple[Any, GradBuffer, torch.Tensor], self._reduce)  # launched this backward
        work.wait()
        self._reduce = None
        if self.replicate_group is not None:  # hybrid sharding: sum the shard (and flags) over the replicas
            ops.all_reduce(out, self.replicate_group)
        if shares_storage(out, buffer.data):
            out = out.clone()  # this rank's row is a view of the whole buffer on gloo: keep the row alone
        grads, present = buffer.split(out)
        grads.div_(self.n * self.replicas)
        self.grad_shard = grads if self.grad_shard is None else self.grad_shard.add_(grads)
        self.present = [a or b for a, b in zip(self.present, present)]
        self.ready.clear()
        self.launched = False

    def grad_of(self, index: int) -> torch.Tensor | None:
        """This rank's averaged rows of parameter ``index``'s gradient; None if no rank produced one."""
        if self.grad_shard is None or not self.present[index]:
            return None
        return self.layout.shard_view(self.grad_shard, index)

    def drop_grads(self) -> None:
        self.grad_shard = None
        self.present = [False] * len(self.params)
