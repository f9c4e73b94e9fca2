"""`DataParallel`: replicated model, gradients averaged by bucketed, overlapped reductions.

One step on N ranks, each with its own slice of the batch::

    model = DataParallel(net, group=mesh.group("dp"))   # broadcast from the group's first rank
    loss_fn(model(x_local), y_local).backward()         # buckets reduce while backward runs
    model.finish_grad_sync()                             # wait; every p.grad is the group average
    optimizer.step()

``zero_stage=1|2`` turns the all-reduce into a reduce-scatter (each rank
receives the averaged gradient rows it will update) for use with
:class:`polyshard.dp.ZeroOptimizer`; stage 2 also keeps only those rows.
Parameter sets may reduce over their own groups (``param_sets``), e.g. MoE
experts over the expert-data-parallel group and the rest over dp x ep.

Hybrid sharding (``replicate_group``; stage 3 in
:class:`~polyshard.dp.FullyShardedDataParallel`; FSDP2's HSDP, DeepSpeed's
MiCS): ZeRO shards over ``group`` only, and ``replicate_group`` holds the
replicas of each shard. A bucket is reduce-scattered inside ``group``, its
shard all-reduced across ``replicate_group`` and, after the step, the
parameters all-gathered inside ``group``; the average divides by both sizes::

    dp = 4 as dp_replicate 2 x dp_shard 2, ranks [0, 1, 2, 3]:
    group (shard)      [0, 1] [2, 3]    reduce-scatter, all-gather
    replicate_group    [0, 2] [1, 3]    all-reduce of each shard

Buffers (BatchNorm statistics) are broadcast from the group's first rank
before every forward, as DDP does (``broadcast_buffers=False`` turns it off).

With ``mixed_precision`` (any stage) the reduced gradients live in the fp32
buckets, not in ``p.grad`` (which stays None): step with
:class:`polyshard.dp.ZeroOptimizer`, which reads them through ``grad_shard``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.dp.bucket_shards import BucketShards
from polyshard.dp.buckets import Bucket, assign_buckets
from polyshard.dp.checks import broadcast_and_check, broadcast_from_first, replicas_of
from polyshard.dp.errors import DataParallelError, GradSyncError
from polyshard.dp.flat import ShardSpec
from polyshard.dp.grad_hooks import weak_grad_hook
from polyshard.dp.mixed_precision import MixedPrecision, cast_inputs, compute_dtype, reduce_dtype
from polyshard.mesh import Replicate, TensorPlacement, get_placement, set_placement

_Reduction = tuple[list[tuple[str, nn.Parameter]], dist.ProcessGroup, int, dist.ProcessGroup | None]
"""Parameters reduced together: ((name, param) list, group, divide_by, replicate group or None)."""


@dataclass(frozen=True)
class ParamSet:
    """Parameters that reduce over their own ``group`` (default: the wrapper's group).

    ``divide_by`` is what the summed gradient is divided by (default: the
    group's size). For experts reduced over the expert-dp group while the loss
    is a mean over the whole dp x ep batch, pass the dp x ep size.
    """

    params: Sequence[nn.Parameter]
    group: dist.ProcessGroup
    divide_by: int | None = None
    axis: str | tuple[str, ...] | None = None
    """Mesh axis (or axes) ``group`` spans, for placement records (default: the wrapper's ``axis``)."""
    replicate_group: dist.ProcessGroup | None = None
    """Hybrid sharding: the replicas of each shard, all-reduced after the reduce-scatter inside ``group``."""
    replicate_axis: str | tuple[str, ...] | None = None
    """Mesh axis (or axes) ``replicate_group`` spans, for placement records."""


class DataParallel(BucketShards, nn.Module):
    """Wrap ``module`` for data parallelism over ``group`` (see module docstring); the
    :class:`~polyshard.dp.DataParallelWrapper` services ZeroOptimizer uses come from
    :class:`~polyshard.dp.bucket_shards.BucketShards`."""

    def __init__(
        self,
        module: nn.Module,
        *,
        group: dist.ProcessGroup,
        bucket_cap_mb: float = 25,
        zero_stage: int = 0,
        mixed_precision: MixedPrecision | None = None,
        param_sets: Sequence[ParamSet] = (),
        axis: str | tuple[str, ...] = "dp",
        broadcast_buffers: bool = True,
        replicate_group: dist.ProcessGroup | None = None,
        replicate_axis: str | tuple[str, ...] | None = None,
    ):
        super().__init__()
        if zero_stage not in (0, 1, 2):
            raise DataParallelError(
                f"DataParallel supports zero_stage 0, 1 or 2, not {zero_stage}; "
                "for stage 3 wrap the model in FullyShardedDataParallel"
            )
        if zero_stage == 0 and (
            replicate_group is not None or any(ps.replicate_group is not None for ps in param_sets)
        ):
            raise DataParallelError(
                "replicate_group (hybrid sharding) needs zero_stage 1 or 2: at stage 0 nothing is sharded, "
                "so pass the whole data-parallel group as group"
            )
        if not bucket_cap_mb > 0:
            raise DataParallelError(f"bucket_cap_mb={bucket_cap_mb} must be positive (25 is a good default)")
        self.module, self.group, self.zero_stage, self.axis = module, group, zero_stage, axis
        self.replicate_group, self.replicate_axis = replicas_of(replicate_group), replicate_axis
        self.mixed_precision = mixed_precision
        self.broadcast_buffers = broadcast_buffers
        self._sync_enabled = True
        self._grads_pending = False
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # frozen ones are not reduced
        # A set's frozen parameters (experts frozen beside LoRA adapters) are replicated over the set's group
        # only: each ep rank holds other experts, which the wrapper's whole group must not overwrite.
        name_of = {id(p): n for n, p in module.named_parameters()}
        foreign = [p for ps in param_sets for p in ps.params if id(p) not in name_of]
        if foreign:
            raise DataParallelError(
                f"a ParamSet holds a tensor of shape {tuple(foreign[0].shape)} that is not a parameter of the "
                "wrapped module; list only the module's own parameters"
            )
        frozen_sets = [
            (ps, [(name_of[id(p)], cast(torch.Tensor, p)) for p in ps.params if not p.requires_grad])
            for ps in param_sets
        ]
        in_sets = {id(p) for _, frozen in frozen_sets for _, p in frozen}
        param_sets = [replace(ps, params=[p for p in ps.params if p.requires_grad]) for ps in param_sets]
        sets = self._resolve_sets(named, param_sets)
        for set_params, set_group, _, set_replicas in sets:
            broadcast_and_check(list(set_params), set_group, set_replicas)
        for ps, frozen in frozen_sets:
            if frozen:  # the same on every rank of the set's group: its members are frozen alike
                broadcast_and_check(frozen, ps.group, replicas_of(ps.replicate_group))
        # Frozen parameters and buffers are not reduced, but every rank must start from the same ones.
        states = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and id(p) not in in_sets]
        broadcast_and_check(states + list(module.named_buffers()), group, self.replicate_group)
        self._master_init = self._stash_masters(sets)
        self._homes: dict[int, torch.Tensor] = {}  # padded storage of parameters whose rows are masters
        if mixed_precision is not None:  # frozen layers compute in the same dtype as the rest
            for p in module.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(mixed_precision.param_dtype)
        # One queue per process group: buckets on one communicator must launch in one order on every
        # rank, and a queue launches strictly in index order (sets sharing a group share a queue).
        queues: dict[int, list[Bucket]] = {}
        for set_params, set_group, divide_by, set_replicas in sets:
            buckets = self._build_buckets(set_params, set_group, divide_by, set_replicas, int(bucket_cap_mb * 2**20))
            queues.setdefault(id(set_group), []).extend(buckets)
        self.queues = list(queues.values())
        self._where = {id(p): (b, i) for q in self.queues for b in q for i, p in enumerate(b.params)}
        for position, queue in enumerate(self.queues):
            # A solo bucket (nothing to reduce, see polyshard.dp.buckets) needs no hook: finish_grad_sync
            # launches it, and a second backward before that only adds to p.grad, as on one process.
            for bucket in (b for b in queue if not b.solo):
                for p in bucket.params:
                    weak_grad_hook(p, self._on_grad_ready, position)  # weakly: see polyshard.dp.grad_hooks

    # -- construction ---------------------------------------------------------
    def _resolve_sets(self, named: list[tuple[str, nn.Parameter]], param_sets: Sequence[ParamSet]) -> list[_Reduction]:
        """[(named params, group, divide_by, replicate group)]: the explicit sets, then everything else
        on ``self.group`` (and ``self.replicate_group``)."""
        claimed: dict[int, str] = {}
        self._axis_of: dict[int, str | tuple[str, ...]] = {}  # parameters whose group spans other axes
        self._replicate_axis_of: dict[int, str | tuple[str, ...] | None] = {}
        by_id = {id(p): n for n, p in named}
        sets = []
        for ps in param_sets:
            if ps.divide_by is not None and (not isinstance(ps.divide_by, int) or ps.divide_by < 1):
                raise DataParallelError(
                    f"ParamSet divide_by={ps.divide_by!r} must be a positive integer (or None for the group size)"
                )
            members = []
            for p in ps.params:
                if id(p) not in by_id:
                    raise DataParallelError(
                        f"a ParamSet holds a tensor of shape {tuple(p.shape)} that is not a trainable parameter "
                        "of the wrapped module; list only the module's own parameters with requires_grad=True"
                    )
                if id(p) in claimed:
                    raise DataParallelError(f"{by_id[id(p)]!r} is listed in two ParamSets; give each parameter one")
                claimed[id(p)] = by_id[id(p)]
                members.append((by_id[id(p)], p))
                if ps.axis is not None:
                    self._axis_of[id(p)] = ps.axis
                self._replicate_axis_of[id(p)] = ps.replicate_axis
            replicas = replicas_of(ps.replicate_group)
            divide_by = ps.divide_by if ps.divide_by is not None else _data_ranks(ps.group, replicas)
            sets.append((members, ps.group, divide_by, replicas))
        rest = [(n, p) for n, p in named if id(p) not in claimed]
        sets.append((rest, self.group, _data_ranks(self.group, self.replicate_group), self.replicate_group))
        return [s for s in sets if s[0]]

    def _stash_masters(self, sets: list[_Reduction]) -> dict[int, torch.Tensor]:
        """fp32 copies of this rank's rows, taken before a cast to a lower compute dtype loses bits.
        Parameters that stay fp32 need none: ``master_init`` hands out views of their own rows."""
        if self.mixed_precision is None:
            return {}
        stash = {}
        for set_params, set_group, _, _ in sets:
            n = 1 if self.zero_stage == 0 else dist.get_world_size(set_group)
            rank = dist.get_rank(set_group) if self.zero_stage else 0
            for _, p in set_params:
                dtype = compute_dtype(p, self.mixed_precision)
                if dtype != torch.float32:
                    stash[id(p)] = ShardSpec(tuple(p.shape), n).shard_of(p.detach().float(), rank)
                p.data = p.data.to(dtype)
        return stash

    def _build_buckets(
        self,
        set_params: list[tuple[str, nn.Parameter]],
        set_group: dist.ProcessGroup,
        divide_by: int,
        replicate_group: dist.ProcessGroup | None,
        cap_bytes: int,
    ) -> list[Bucket]:
        params = [p for _, p in set_params]
        buckets = []
        for indices in assign_buckets(params, cap_bytes):
            names = [set_params[i][0] for i in indices]
            members = [params[i] for i in indices]
            for name, p in zip(names, members):
                record = get_placement(p) or TensorPlacement(name, tuple(p.shape))
                axis = self._axis_of.get(id(p), self.axis)
                replicate_axis = self._replicate_axis_of.get(id(p), self.replicate_axis)
                for a in _axes(replicate_axis) + _axes(axis):  # replicas outer: records list outer axes first
                    record = record.with_axis(a, Replicate())
                set_placement(p, record)
            buckets.append(
                Bucket(
                    members,
                    names,
                    group=set_group,
                    stage=self.zero_stage,
                    reduce_dtype=reduce_dtype(members[0], self.mixed_precision),
                    divide_by=divide_by,
                    replicate_group=replicate_group,
                )
            )
        return buckets

    # -- the step ---------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            # A rank whose backward ends up producing no gradient must still join this step's
            # reductions in finish_grad_sync, or the ranks that did would wait for it forever.
            self._grads_pending = True
        if self.broadcast_buffers:
            self._sync_buffers()
        if self.mixed_precision is not None:
            args, kwargs = cast_inputs((args, kwargs), self.mixed_precision.param_dtype)
        return self.module(*args, **kwargs)

    def _sync_buffers(self) -> None:
        """Give every replica the first rank's buffers (BatchNorm's running statistics, which each rank
        updates from its own batch), before each forward, as DDP does by default: one broadcast per
        dtype over the wrapper's ``group`` (buffers that differ by design across it, e.g. per expert
        rank, need ``broadcast_buffers=False``)."""
        buffers = [b for b in self.module.buffers() if b is not None]
        groups = [g for g in (self.group, self.replicate_group) if g is not None and dist.get_world_size(g) > 1]
        if not buffers or not groups:
            return
        for dtype in dict.fromkeys(b.dtype for b in buffers):
            same = [b for b in buffers if b.dtype == dtype]
            flat = torch.cat([b.reshape(-1) for b in same])
            for g in groups:  # inside the shard group, then across replicas: everyone gets the first rank's
                broadcast_from_first([flat], g)
            with torch.no_grad():
                for b, value in zip(same, flat.split([b.numel() for b in same])):
                    b.copy_(value.view_as(b))

    def _on_grad_ready(self, queue: int, param: nn.Parameter) -> None:
        """``param``'s gradient of this backward is final: launch the buckets of ``self.queues[queue]`` that
        are complete now."""
        if not self._grads_pending:  # read first: a write goes through nn.Module.__setattr__, slow per parameter
            self._grads_pending = True
        if not self._sync_enabled:
            return  # no_sync: let the gradient accumulate in param.grad
        bucket, index = self._where[id(param)]
        if bucket.launched or index in bucket.ready:
            # Its reduction already holds the previous backward's gradient; this one would be lost.
            raise GradSyncError(
                "a second backward reached a parameter before finish_grad_sync(): call finish_grad_sync() "
                "(or the optimizer step) between steps, and wrap every backward but the last of a step "
                "in no_sync() when accumulating gradients"
            )
        bucket.ready.add(index)
        self._launch_in_order(self.queues[queue], only_complete=True)

    @staticmethod
    def _launch_in_order(queue: list[Bucket], *, only_complete: bool) -> None:
        """Launch buckets in index order; stop at the first incomplete one unless told otherwise."""
        for bucket in queue:
            if bucket.launched:
                continue
            if only_complete and not bucket.complete:
                return
            bucket.launch()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside reduces the sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Wait for every reduction; call before the optimizer step.

        Buckets not yet launched (a parameter got no gradient on this rank this
        step) are launched now with zeros for the missing gradients, in the
        same order on every rank, so no rank waits on a collective another
        skipped. A parameter with no gradient on any rank keeps ``grad = None``
        (the presence flags travel in the same reduction), so the optimizer
        skips it, as it would on one process.
        """
        if not self._grads_pending:
            return
        for queue in self.queues:
            self._launch_in_order(queue, only_complete=False)
        for queue in self.queues:
            for bucket in queue:
                bucket.wait()
                bucket.ready.clear()
                bucket.launched = False
        self._grads_pending = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for bucket in self.buckets():
            bucket.drop_grads()


def _axes(axis: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


def _data_ranks(group: dist.ProcessGroup, replicate_group: dist.ProcessGroup | None) -> int:
    """Ranks a gradient averages over: the shard group times its replicas."""
    return dist.get_world_size(group) * (1 if replicate_group is None else dist.get_world_size(replicate_group))
