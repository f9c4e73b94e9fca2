"""Column- and row-parallel linear layers (Megatron-LM, 1909.08053, section 3).

A linear layer y = x W^T + b with W of shape (O, I):

* column-parallel splits W along O (dim 0): each rank computes O/tp output
  features from the whole input; the MLP's first layer and q/k/v are column
  parallel, so each rank owns whole hidden units / whole heads.
* row-parallel splits W along I (dim 1): each rank multiplies its I/tp input
  features and the partial outputs are summed; the MLP's second layer and the
  attention output projection are row parallel, so a column-row pair needs
  one reduction forward and one backward.

Built directly, a layer initialises the *full* weight exactly as ``nn.Linear``
does and keeps its slice, so one seed gives the same global weights for any
tp (and the same as ``nn.Linear``). ``source=`` slices an existing layer
instead, which is how :func:`polyshard.tp.parallelize` converts models.

Shapes: B batch, S sequence, I in features, O out features, tp the group size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.collectives import gather_from, scatter_to
from polyshard.tp.overlap import check_options, column_parallel_matmul
from polyshard.tp.regions import enter_region, leave_region
from polyshard.tp.shard import (
    check_divides,
    mark_sequence_parallel,
    padded_size,
    record_replicate,
    record_shard,
    take_shard,
    tp_size,
)


def _full_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    source: nn.Linear | None,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> nn.Linear:
    if source is not None:
        return source
    # nn.Linear's own init (kaiming-uniform weight, uniform bias) draws the same numbers for any tp.
    return nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)


class ColumnParallelLinear(nn.Module):
    """Weight split along the output features: local weight (O/tp, I), local bias (O/tp).

    forward: enter the tp region (identity; all-gather along the sequence dim
    when ``sequence_parallel``), then (B, S, I) @ (I, O/tp) -> (B, S, O/tp);
    with ``gather_output`` all-gather the features back to (B, S, O).
    backward: the entry's conjugate sums the input gradient over the group.

    ``input_entered``: an enclosing module already entered the region for this
    input (see :class:`polyshard.tp.TPEntry`), so q/k/v share one collective
    instead of one each. ``pad_output``: pad O up to a multiple of tp with
    zero rows (a vocabulary head); ``gather_output`` drops the padding again.

    ``overlap`` (default): entry and matmul are one autograd Function whose
    backward sums the input gradient over tp *while* it computes the weight
    gradient (:mod:`polyshard.tp.overlap`); False builds them from the region
    collectives, one after the other. With ``sequence_parallel`` two more
    options: ``regather_input`` keeps only the input's sequence shard for
    backward and gathers it again there (less memory, one more all-gather);
    ``overlap_forward_gather`` multiplies this rank's shard while the others
    arrive. Neither applies with ``input_entered`` (no collective here).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: dist.ProcessGroup | None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        input_entered: bool = False,
        pad_output: bool = False,
        sequence_dim: int = 1,
        overlap: bool = True,
        regather_input: bool = False,
        overlap_forward_gather: bool = False,
        axis: str = "tp",
        source: nn.Linear | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        check_options(sequence_parallel, input_entered, overlap, regather_input, overlap_forward_gather)
        tp = tp_size(tp_group)
        if source is not None:
            in_features, out_features, bias = source.in_features, source.out_features, source.bias is not None
        padded = padded_size(out_features, tp) if pad_output else out_features
        check_divides(padded, tp, "out_features")
        self.in_features, self.out_features, self.padded_out_features = in_features, out_features, padded
        self.tp_group, self.axis = tp_group, axis
        self.gather_output, self.sequence_parallel, self.input_entered = gather_output, sequence_parallel, input_entered
        self.sequence_dim = sequence_dim
        self.overlap, self.regather_input, self.overlap_forward_gather = overlap, regather_input, overlap_forward_gather
        full = _full_linear(in_features, out_features, bias, source, device, dtype)
        self.weight = nn.Parameter(take_shard(full.weight, 0, tp_group, padded))
        record_shard(self.weight, "weight", (out_features, in_features), 0, axis, (padded, in_features))
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(take_shard(full.bias, 0, tp_group, padded))
            record_shard(self.bias, "bias", (out_features,), 0, axis, (padded,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_entered:  # the region was entered upstream: nothing to overlap here
            y = F.linear(x, self.weight, self.bias)  # (B, S, I) @ (I, O/tp) -> (B, S, O/tp)
        elif self.overlap:  # entry + matmul in one Function; its backward overlaps the gradient's sum
            y = column_parallel_matmul(
                x,
                self.weight,
                self.bias,
                self.tp_group,
                sequence_parallel=self.sequence_parallel,
                sequence_dim=self.sequence_dim,
                regather_input=self.regather_input,
                overlap_forward_gather=self.overlap_forward_gather,
            )
        else:
            x = enter_region(x, self.tp_group, self.sequence_parallel, self.sequence_dim)
            y = F.linear(x, self.weight, self.bias)
        if not self.gather_output:
            return y
        y = gather_from(y, -1, self.tp_group)  # (B, S, O/tp) -> (B, S, padded O)
        return y[..., : self.out_features]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local {self.weight.shape[0]}), "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}, overlap={self.overlap}"
        )


class RowParallelLinear(nn.Module):
    """Weight split along the input features: local weight (O, I/tp), bias (O) replicated.

    forward: (unless ``input_is_parallel``, split the input features first)
    (B, S, I/tp) @ (I/tp, O) -> partial (B, S, O); leave the tp region:
    all-reduce, or reduce-scatter along the sequence dim to (B, S/tp, O) when
    ``sequence_parallel``; then add the bias once.
    backward: identity (all-gather with SP) for the output gradient.

    With ``sequence_parallel`` the bias is added on a sequence shard, so it is
    flagged for :func:`polyshard.tp.sync_sequence_parallel_grads`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: dist.ProcessGroup | None,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        axis: str = "tp",
        source: nn.Linear | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if source is not None:
            in_features, out_features, bias = source.in_features, source.out_features, source.bias is not None
        check_divides(in_features, tp_size(tp_group), "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.axis = tp_group, axis
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.sequence_dim = sequence_dim
        full = _full_linear(in_features, out_features, bias, source, device, dtype)
        self.weight = nn.Parameter(take_shard(full.weight, 1, tp_group))
        record_shard(self.weight, "weight", (out_features, in_features), 1, axis)
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(full.bias.detach().clone())
            record_replicate(self.bias, "bias", axis)
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        self.partial_addend: Callable[[torch.Tensor], torch.Tensor] | None = None
        """A function of the local input (B, S, I/tp) whose (B, S, O) result joins the partial sums before
        they are reduced: another partial product (a LoRA adapter's) then costs no reduction of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to(x, -1, self.tp_group)  # (B, S, I) -> (B, S, I/tp)
        partial = F.linear(x, self.weight)  # (B, S, I/tp) @ (I/tp, O) -> partial sums (B, S, O)
        if self.partial_addend is not None:
            partial = partial + self.partial_addend(x)
        y = leave_region(partial, self.tp_group, self.sequence_parallel, self.sequence_dim)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}"
        )
