"""The interface both data-parallel wrappers offer, declared once.

:class:`~polyshard.dp.DataParallel` (stages 0-2) and
:class:`~polyshard.dp.FullyShardedDataParallel` (stage 3) differ in what they
keep, not in what their users ask of them: :class:`~polyshard.dp.ZeroOptimizer`
steps through it, a trainer reads gradients and records through it, and
checkpoint code finds each parameter's shard through it. Code that accepts
either wrapper is typed against :class:`DataParallelWrapper`.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from polyshard.dp.flat import ShardSpec
from polyshard.mesh import TensorPlacement


@runtime_checkable
class DataParallelWrapper(Protocol):
    module: nn.Module
    """The wrapped model (its parameters keep their names)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate locally; the next one outside reduces (pipelines enter it)."""
        ...

    def finish_grad_sync(self) -> None:
        """Wait for every reduction of this step; gradients are final afterwards."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def owned_params(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of every trainable parameter the wrapper reduces, in reduction order."""
        ...

    def shard_spec(self, param: nn.Parameter) -> ShardSpec:
        """How ``param``'s dim 0 is split over the data ranks (n = 1 when nothing is sharded)."""
        ...

    def shard_group(self, param: nn.Parameter) -> dist.ProcessGroup:
        """The process group ``param``'s rows and its optimizer state are sharded over; this rank holds
        rows block ``dist.get_rank(shard_group(param))`` of ``shard_spec(param)``. With hybrid sharding
        it is the shard group: the other replicas (``replicate_group``) hold the same rows."""
        ...

    def shard_placement(self, param: nn.Parameter, name: str) -> TensorPlacement:
        """The placement record of this rank's rows of ``param`` (its optimizer state's too)."""
        ...

    def grad_shard(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's reduced, averaged rows of ``param``'s gradient; None if no rank produced one."""
        ...

    def master_init(self, param: nn.Parameter) -> torch.Tensor:
        """fp32 values of this rank's rows of ``param``, for an optimizer's master copy."""
        ...

    def write_params(self, values: Mapping[int, torch.Tensor]) -> None:
        """Set the parameters from updated rows (keyed by ``id(param)``)."""
        ...

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors held for parameters and gradients (for :func:`polyshard.dp.bytes_held`)."""
        ...
