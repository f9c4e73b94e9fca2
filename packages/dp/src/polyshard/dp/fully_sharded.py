"""`FullyShardedDataParallel`: ZeRO-3, parameters sharded over the dp group too.

Rajbhandari et al., "ZeRO", 1910.02054, stage P_os+g+p. Each block of the
model is a :class:`~polyshard.dp.units.Unit`. One step on N ranks::

    forward   block i:  gather(i) [prefetched]  start gather(i+1)  compute  free(i)
    backward  block i:  gather(i) [prefetched]  start gather(i-1)  compute
                        all grads of i ready -> reduce-scatter(i) (async), free(i)
    end of backward:    wait every reduce-scatter, add into the gradient shards

Parameters not in any block (e.g. embedding and head) form the root unit: it
is gathered when the forward starts and freed at the end of backward. Per
step that is two all-gathers and one reduce-scatter of every block's
parameters (3 x parameter volume), one all-gather less for the root.

A block in ``keep_gathered`` (FSDP2's ``reshard_after_forward=False``) is not
freed after its forward: it stays gathered until the backward of every
forward it ran has reduced its gradients, one all-gather less per microbatch.
The trainer keeps the output head so (torchtitan's default for the last
layers): its backward starts right after its forward, and the chunked loss
(``training.loss_chunks``) multiplies by its weight after its forward and
again in its backward.

Gradient accumulation: every backward reduce-scatters and the shards add up,
so the full gradients are never kept.

Hybrid sharding (``replicate_group``; FSDP2's HSDP): parameters are sharded
over ``group`` only and every gather stays inside it; after each
reduce-scatter the shard is all-reduced across ``replicate_group``.

Frozen parameters (``requires_grad=False``: LoRA's base) are sharded and
gathered like the others, in units of their own (one per block and dtype, so a
base kept in bf16 gathers in bf16 beside fp32 adapters), but get no gradient
hook, no reduce-scatter and no optimizer master. A frozen unit is gathered
before its block's forward and again before its backward; it is freed after
the forward and once the gradient of the block's input is computed (every
node that read the weights lies between the block's output and its input),
or at the end of the backward when the input needs no gradient (the first
block after a frozen embedding). The frozen root (a frozen weight tied
between blocks) stays gathered from the forward until the last backward that
waits for it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from polyshard.dp.block_hooks import after_backward, by_dtype, tensors_in
from polyshard.dp.checks import broadcast_and_check, replicas_of
from polyshard.dp.errors import DataParallelError
from polyshard.dp.flat import ShardSpec, shard_record
from polyshard.dp.grad_hooks import weak_grad_hook
from polyshard.dp.mixed_precision import MixedPrecision, cast_inputs, compute_dtype, reduce_dtype
from polyshard.dp.units import Unit
from polyshard.mesh import TensorPlacement, get_placement


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s trainable parameters over ``group`` block by block.

    ``blocks`` are submodules in execution order (default: the module's
    children, right for ``nn.Sequential``-like models). Frozen floating-point
    parameters are sharded too, in units that are never reduced.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        group: dist.ProcessGroup,
        blocks: Sequence[nn.Module] | None = None,
        mixed_precision: MixedPrecision | None = None,
        prefetch: bool = True,
        axis: str | tuple[str, ...] = "dp",
        replicate_group: dist.ProcessGroup | None = None,
        replicate_axis: str | tuple[str, ...] | None = None,
        keep_gathered: Sequence[nn.Module] = (),
    ):
        super().__init__()
        self.module, self.group, self.mixed_precision, self.prefetch = module, group, mixed_precision, prefetch
        self.axis = axis
        self.replicate_group, self.replicate_axis = replicas_of(replicate_group), replicate_axis
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and p.is_floating_point()]
        states = list(module.named_parameters()) + list(module.named_buffers())
        broadcast_and_check(states, group, self.replicate_group)
        blocks = list(module.children()) if blocks is None else list(blocks)
        kept = {id(b) for b in keep_gathered}
        if kept - {id(b) for b in blocks}:
            raise DataParallelError("keep_gathered names a module that is not one of the blocks; pass blocks of it")
        self.block_units: list[Unit] = []
        self.frozen_units: list[Unit] = []  # frozen parameters, one unit per block and dtype
        self._make_units(self.block_units, named, blocks, kept)
        self._make_units(self.frozen_units, frozen, blocks, kept)
        # A block whose parameters all went to the root (shared ones) has no unit of its own: nothing to keep.
        self._kept = [u for u in self.block_units + self.frozen_units if u.keep]
        claimed = {id(p) for u in self.block_units + self.frozen_units for p in u.params}
        rest = [(n, p) for n, p in named if id(p) not in claimed]
        self.root = self._unit(rest) if rest else None
        frozen_rest = [(n, p) for n, p in frozen if id(p) not in claimed]
        self.frozen_roots = [self._unit(same, trainable=False) for same in by_dtype(frozen_rest)]
        self._root_forwards = 0  # forwards whose backward has not finished: the frozen roots stay gathered
        # Backward reduces the last block first; the root comes last.
        self.reduce_order = list(reversed(self.block_units)) + ([self.root] if self.root else [])
        self._where = {id(p): (u, i) for u in self.reduce_order for i, p in enumerate(u.params)}
        for unit in self.reduce_order:
            for p in unit.params:
                weak_grad_hook(p, self._on_grad_ready)  # weakly: see polyshard.dp.grad_hooks
        self._callback_queued = False

    def _unit(self, named: list[tuple[str, nn.Parameter]], *, trainable: bool = True) -> Unit:
        p = named[0][1]
        return Unit(
            named,
            group=self.group,
            dtype=compute_dtype(p, self.mixed_precision),
            reduce_dtype=reduce_dtype(p, self.mixed_precision),
            axis=self.axis,
            replicate_group=self.replicate_group,
            replicate_axis=self.replicate_axis,
            trainable=trainable,
        )

    def _make_units(
        self, units: list[Unit], named: list[tuple[str, nn.Parameter]], blocks: list[nn.Module], kept: set[int]
    ) -> None:
        """Append to ``units`` one unit per block of ``named``'s parameters (trainable ones), or one per
        block and dtype (frozen ones, whose dtypes may differ), and hook each to its block."""
        trainable = units is self.block_units
        name_of = {id(p): n for n, p in named}
        # A parameter used by several blocks (a tied embedding and output head) must stay gathered from
        # the first user's forward to the last user's backward: it belongs to the root unit, which
        # encloses every block (gathered when the forward starts, freed once its gradients are reduced).
        users: dict[int, int] = {}
        for block in blocks:
            for p in {id(p): p for p in block.parameters()}.values():
                users[id(p)] = users.get(id(p), 0) + 1
        seen = {key for key, count in users.items() if count > 1}
        for block in blocks:
            members = [(name_of[id(p)], p) for p in block.parameters() if id(p) in name_of and id(p) not in seen]
            seen.update(id(p) for _, p in members)
            for same in [members] if trainable else by_dtype(members):
                if not same:
                    continue
                position = len(units)
                units.append(self._unit(same, trainable=trainable))
                units[-1].keep = id(block) in kept  # keep_gathered
                before = functools.partial(self._pre_forward, units, position)
                block.register_forward_pre_hook(lambda mod, args, run=before: run(args))
                after = functools.partial(self._post_forward, units, position)
                block.register_forward_hook(lambda mod, args, out, run=after: run(out))

    # -- forward ------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.mixed_precision is not None:
            args, kwargs = cast_inputs((args, kwargs), self.mixed_precision.param_dtype)
        self._free_kept(waiting=False)  # left gathered by a forward without backward (an evaluation)
        if self.root is not None:
            self.root.gather()
        for unit in self.frozen_roots:
            unit.gather()
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._root_forwards += 1
        elif not self._root_forwards:  # an evaluation: no backward will read the frozen roots
            self._free_frozen_roots()
        return output

    def _free_frozen_roots(self) -> None:
        for unit in self.frozen_roots:
            unit.free()

    def _free_kept(self, *, waiting: bool) -> None:
        """Free the kept blocks no backward waits for; with ``waiting``, every kept block (the step's end:
        one backward over several forwards, or a recomputed forward, leaves counts no backward will take)."""
        for unit in self._kept:
            if waiting or unit.awaiting_backward == 0:
                unit.awaiting_backward = 0
                unit.free()

    def _pre_forward(self, units: list[Unit], i: int, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        units[i].gather()
        if self.prefetch and i + 1 < len(units):
            units[i + 1].start_gather()
        if units[i].trainable or not torch.is_grad_enabled():
            return None
        # A frozen unit is freed once the gradient of the block's input exists (see the module docstring).
        return after_backward(args, functools.partial(self._post_backward_frozen, i))

    def _post_forward(self, units: list[Unit], i: int, output: object) -> None:
        unit = units[i]
        if not unit.keep:
            unit.free()
        if not torch.is_grad_enabled():
            return  # a kept block stays gathered for the caller; the next forward or step frees it
        if unit.keep:
            unit.awaiting_backward += 1
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        fired: list[bool] = []

        def pre_backward(grad: torch.Tensor) -> torch.Tensor:
            if not fired:  # once per backward even when the block has several outputs
                fired.append(True)
                self._pre_backward(units, i)
            return grad

        for t in tensors:
            t.register_hook(pre_backward)

    # -- backward -----------------------------------------------------------------------
    def _pre_backward(self, units: list[Unit], i: int) -> None:
        self._queue_finish()
        units[i].gather()
        if self.prefetch and i > 0:
            units[i - 1].start_gather()

    def _post_backward_frozen(self, i: int) -> None:
        """The gradient of frozen unit ``i``'s block input is computed: nothing reads its weights again."""
        unit = self.frozen_units[i]
        unit.awaiting_backward = max(unit.awaiting_backward - 1, 0)
        if not unit.awaiting_backward:
            unit.free()

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._queue_finish()
        unit, index = self._where[id(param)]
        unit.ready.add(index)
        self._launch_in_order(only_complete=True)

    def _launch_in_order(self, *, only_complete: bool) -> None:
        # Same order on every rank, so reduce-scatters always pair up.
        for unit in self.reduce_order:
            if unit.launched:
                continue
            if only_complete and not unit.complete:
                return
            unit.launch_reduce()

    def _queue_finish(self) -> None:
        """Run :meth:`_finish_backward` when the autograd engine finishes this backward."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        self._launch_in_order(only_complete=False)  # blocks that got no gradient count as zeros
        for unit in self.reduce_order:
            unit.wait_reduce()
            unit.drop_prefetch()  # a prefetched block that never ran must not outlive the step
        for unit in self.frozen_units:  # blocks whose input needed no gradient; kept ones wait their count
            unit.drop_prefetch()
            if not unit.keep:
                unit.free()
        self._root_forwards = max(self._root_forwards - 1, 0)
        if not self._root_forwards:
            self._free_frozen_roots()
        self._callback_queued = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accepted for symmetry with DataParallel (e.g. a pipeline executor's hook); changes nothing.

        ZeRO-3 reduce-scatters after every backward and sums the shards, so
        gradient accumulation is already correct and never holds full gradients.
        """
        yield

    def finish_grad_sync(self) -> None:
        """Each backward finishes its own reductions; only unused prefetches can be left to drop, and a
        kept block still gathered (the optimizer step rewrites the rows it came from)."""
        for unit in self.reduce_order + self.frozen_units:
            unit.drop_prefetch()
        self._free_kept(waiting=True)
        self._root_forwards = 0  # forwards run without a backward (a recomputation's) wait for none
        self._free_frozen_roots()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for unit in self.reduce_order:
            unit.drop_grads()

    # -- what ZeroOptimizer needs ------------------------------------------------------
    def owned_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for u in self.reduce_order for n, p in zip(u.names, u.params)]

    def shard_spec(self, param: nn.Parameter) -> ShardSpec:
        unit, index = self._where[id(param)]
        return unit.layout.specs[index]

    def shard_group(self, param: nn.Parameter) -> dist.ProcessGroup:
        """The group ``param``'s rows and optimizer state are sharded over (``group``)."""
        return self._where[id(param)][0].group

    def master_init(self, param: nn.Parameter) -> torch.Tensor:
        unit, _ = self._where[id(param)]
        return unit.master_init.pop(id(param))

    def shard_placement(self, param: nn.Parameter, name: str) -> TensorPlacement:
        return shard_record(get_placement(param), name, self.shard_spec(param), self.axis)

    def grad_shard(self, param: nn.Parameter) -> torch.Tensor | None:
        unit, index = self._where[id(param)]
        return unit.grad_of(index)

    def write_params(self, values: Mapping[int, torch.Tensor]) -> None:
        for unit in self.reduce_order:
            unit.write_local(values)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every sharded parameter's full value (copies; all-gathers each block once). Call on all ranks."""
        out = {}
        for unit in self.reduce_order + self.frozen_units + self.frozen_roots:
            was_gathered = unit.gathered
            unit.gather()
            out.update({n: p.detach().clone() for n, p in zip(unit.names, unit.params)})
            if not was_gathered:
                unit.free()
        return out

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's rows of every sharded parameter, frozen ones too (views with placement records), for
        checkpoints."""
        units = self.reduce_order + self.frozen_units + self.frozen_roots
        return {n: v for u in units for n, v in zip(u.names, u.local_views)}

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank holds for parameters and gradients (for :func:`polyshard.dp.bytes_held`)."""
        units = self.reduce_order + self.frozen_units + self.frozen_roots
        params = list(self.module.parameters()) + [u.local for u in units]
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        grads += [u.grad_shard for u in self.reduce_order if u.grad_shard is not None]
        return {"params": params, "grads": grads}
