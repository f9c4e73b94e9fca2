"""The services ZeroOptimizer needs from :class:`~polyshard.dp.DataParallel`, over its buckets.

ZeRO-1/2 keep each rank's rows of every gradient in the buckets' reduced
shards (:mod:`polyshard.dp.buckets`). The optimizer steps this rank's rows of
each parameter and hands them back, and the parameters are all-gathered from
them. Without mixed precision those rows are a view of the parameter's own
storage (as ZeRO-3's masters are views of its shard, :func:`~polyshard.dp.flat.master_rows`),
so no fp32 copy exists besides the parameters: a parameter whose dim 0 does
not divide by N moves, once, into storage padded to a multiple of N rows.
With mixed precision the master is a separate fp32 copy (it must be).

This mixin answers, for one parameter, where its rows are (shard_spec,
shard_placement), what its master starts from (master_init), what its
reduced gradient is (grad_shard), and writes updated rows back
(write_params). It needs from the class it is mixed into: ``queues`` (the
buckets), ``_where`` (id(param) -> (bucket, index)), ``zero_stage``,
``module``, ``axis``, ``_axis_of``, ``_master_init`` and ``_homes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import ops
from polyshard.dp.buckets import Bucket
from polyshard.dp.flat import ShardSpec, master_rows, padded_home, rows_view, shard_record, write_rows
from polyshard.mesh import TensorPlacement, get_placement


class BucketShards:
    queues: list[list[Bucket]]
    _where: dict[int, tuple[Bucket, int]]
    _master_init: dict[int, torch.Tensor]
    _homes: dict[int, torch.Tensor]
    _axis_of: dict[int, Any]
    zero_stage: int
    module: nn.Module
    axis: str | tuple[str, ...]

    def buckets(self) -> list[Bucket]:
        return [b for q in self.queues for b in q]

    def owned_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for b in self.buckets() for n, p in zip(b.names, b.params)]

    def shard_spec(self, param: nn.Parameter) -> ShardSpec:
        bucket, index = self._where[id(param)]
        return bucket.layout.specs[index]

    def shard_group(self, param: nn.Parameter) -> dist.ProcessGroup:
        """The group ``param``'s rows and optimizer state are sharded over (at stage 0 its rows are the
        whole parameter: ``shard_spec(param).n == 1``). Hybrid sharding: the shard group, not the replicas."""
        return self._where[id(param)][0].group

    def master_init(self, param: nn.Parameter) -> torch.Tensor:
        """fp32 values of this rank's rows of ``param`` (all of it at stage 0): without mixed precision
        a view of the parameter's own storage, which the optimizer then steps in place."""
        if id(param) in self._master_init:  # mixed precision: taken before the cast
            return self._master_init.pop(id(param))
        spec, rank = self.shard_spec(param), self._rank(param)
        return master_rows(param.dtype, lambda: self._rows(param), param.detach(), spec, rank)

    def _rank(self, param: nn.Parameter) -> int:
        bucket, _ = self._where[id(param)]
        return dist.get_rank(bucket.group) if self.zero_stage else 0

    def _rows(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's rows of ``param`` as a view of its storage (see :func:`~polyshard.dp.flat.rows_view`)."""
        spec = self.shard_spec(param)
        home = self._homes.get(id(param))
        if home is not None and home.data_ptr() != param.data_ptr():
            home = None  # ``param.data`` was replaced since (moved to a device, say): it needs a new home
        fits = param.numel() == spec.padded_numel and param.is_contiguous()
        if home is None and not fits:
            home = self._homes[id(param)] = padded_home(param, spec)
        return rows_view(param, spec, self._rank(param), home)

    def shard_placement(self, param: nn.Parameter, name: str) -> TensorPlacement:
        if self.zero_stage == 0:
            return get_placement(param) or TensorPlacement(name, tuple(param.shape))
        return shard_record(get_placement(param), name, self.shard_spec(param), self._axis_of.get(id(param), self.axis))

    def grad_shard(self, param: nn.Parameter) -> torch.Tensor | None:
        bucket, index = self._where[id(param)]
        return bucket.grad_shard(index)

    def write_params(self, values: Mapping[int, torch.Tensor]) -> None:
        """Set parameters from updated rows (keyed by ``id(param)``); stages 1/2 all-gather them."""
        with torch.no_grad():
            if self.zero_stage == 0:
                for p in (p for b in self.buckets() for p in b.params):
                    write_rows(self._rows(p), values[id(p)])  # nothing to copy when the master is p
                return
            pending = [self._gather_bucket(b, values) for b in self.buckets()]
            for bucket, full, work in pending:
                work.wait()
                for index, p in enumerate(bucket.params):
                    self._write_gathered(p, bucket, full, index)

    def _write_gathered(self, p: nn.Parameter, bucket: Bucket, full: torch.Tensor, index: int) -> None:
        """Copy parameter ``index`` of an all-gathered flat bucket into ``p``: straight from the grid's
        row blocks into ``p``'s storage seen as (n, shard_numel) when that storage holds the padded rows
        (dim 0 divides by n, or the padded home of fp32 ZeRO); else through ``unpack``, whose reshape
        of the strided row blocks is itself a copy (a second copy of the whole model every step:
        ``polyshard.bench.pprof --case zero1``)."""
        spec, offset = bucket.layout.specs[index], bucket.layout.offsets[index]
        piece = full.view(spec.n, bucket.layout.shard_numel)[:, offset : offset + spec.shard_numel]
        home = self._homes.get(id(p))
        if home is not None and home.data_ptr() == p.data_ptr() and home.dtype == p.dtype:
            home.view(spec.n, spec.shard_numel).copy_(piece)
        elif p.is_contiguous() and p.numel() == spec.padded_numel:
            p.view(spec.n, spec.shard_numel).copy_(piece)
        else:
            p.copy_(bucket.layout.unpack(full, index))

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank holds for parameters and gradients (for :func:`polyshard.dp.bytes_held`)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        grads += [t for b in self.buckets() for t in b.tensors()]
        return {"params": list(self.module.parameters()), "grads": grads}

    @staticmethod
    def _gather_bucket(bucket: Bucket, values: Mapping[int, torch.Tensor]) -> tuple[Bucket, torch.Tensor, dist.Work]:
        # The collective needs this rank's rows of the whole bucket contiguous: a transient copy of the
        # masters (views of the parameters themselves without mixed precision), freed after the gather.
        dtype, device = bucket.params[0].dtype, bucket.params[0].device
        shard = torch.empty(bucket.layout.shard_numel, dtype=dtype, device=device)
        for index, p in enumerate(bucket.params):
            bucket.layout.shard_view(shard, index).copy_(values[id(p)])
        full = torch.empty(bucket.layout.numel, dtype=dtype, device=device)
        work = ops.all_gather_flat(full, shard, bucket.group, async_op=True)
        return bucket, full, cast(dist.Work, work)  # async_op: always a handle
