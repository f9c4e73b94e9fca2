"""Styles: what :func:`polyshard.tp.parallelize` does to the modules a pattern matches.

Each style checks a module first (``check``, so a bad plan changes nothing)
and then applies itself (``apply``), returning the module that takes the
matched one's place (a new layer, or the same module with hooks/flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.mesh import Placement, Replicate, Shard
from polyshard.tp.errors import PlanError, TPError
from polyshard.tp.heads import ReplicatedKVLinear, heads_per_rank, replicates_kv
from polyshard.tp.linear import ColumnParallelLinear, RowParallelLinear
from polyshard.tp.overlap import check_options
from polyshard.tp.regions import enter_region, split_sequence
from polyshard.tp.shard import (
    check_divides,
    mark_sequence_parallel,
    padded_size,
    record_replicate,
    record_shard,
    tp_size,
)
from polyshard.tp.vocab import VocabParallelEmbedding

ParamLayout = tuple[Placement, tuple[int, ...] | None]
"""A parameter's placement over the tp axis and its padded shape (None when unpadded)."""


class Style:
    """Base of every style: ``accepts`` says which modules it fits, ``check`` validates one
    before anything changes, ``apply`` converts it (subclasses implement it)."""

    replaces = False  # True when apply() returns a new module

    def accepts(self, module: nn.Module) -> bool:
        return True

    def check(self, module: nn.Module, name: str, tp: int) -> None:
        if not self.accepts(module):
            raise PlanError(f"{self} cannot apply to {name!r}, a {type(module).__name__}")

    def apply(self, module: nn.Module, name: str, tp_group: dist.ProcessGroup | None, axis: str) -> nn.Module:
        raise NotImplementedError

    def param_placement(self, param: str, shape: tuple[int, ...], tp: int) -> ParamLayout:
        """How ``apply`` lays out the matched module's parameter ``param`` (full ``shape``) over tp ranks:
        (placement, padded shape or None). Offline tools (checkpoint resharding) read layouts from
        here without building the model; styles that do not split parameters replicate them."""
        return Replicate(), None


@dataclass(frozen=True)
class ColumnParallel(Style):
    """``nn.Linear`` -> :class:`ColumnParallelLinear` (output features split). ``overlap``,
    ``regather_input`` and ``overlap_forward_gather``: see :mod:`polyshard.tp.overlap`."""

    gather_output: bool = False
    sequence_parallel: bool = False
    input_entered: bool = False
    overlap: bool = True
    regather_input: bool = False
    overlap_forward_gather: bool = False
    replaces = True

    def accepts(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    def check(self, module: nn.Module, name: str, tp: int) -> None:
        super().check(module, name, tp)
        module = cast(nn.Linear, module)  # accepts() lets only nn.Linear through
        check_divides(module.out_features, tp, f"out_features of {name}")
        try:
            check_options(
                self.sequence_parallel,
                self.input_entered,
                self.overlap,
                self.regather_input,
                self.overlap_forward_gather,
            )
        except TPError as err:
            raise PlanError(f"{self} on {name!r}: {err}") from None

    def param_placement(self, param: str, shape: tuple[int, ...], tp: int) -> ParamLayout:
        return Shard(0), None  # weight (out, in) and bias (out,): output features split

    def apply(self, module: nn.Module, name: str, tp_group: dist.ProcessGroup | None, axis: str) -> nn.Module:
        module = cast(nn.Linear, module)  # accepts() lets only nn.Linear through
        return ColumnParallelLinear(
            module.in_features,
            module.out_features,
            tp_group=tp_group,
            gather_output=self.gather_output,
            sequence_parallel=self.sequence_parallel,
            input_entered=self.input_entered,
            overlap=self.overlap,
            regather_input=self.regather_input,
            overlap_forward_gather=self.overlap_forward_gather,
            axis=axis,
            source=module,
        )


@dataclass(frozen=True)
class ReplicateKVHeads(Style):
    """A k or v ``nn.Linear`` of ``num_kv_heads`` heads on more tp ranks than heads ->
    :class:`ReplicatedKVLinear`: each kv head computed on tp / num_kv_heads ranks (weights replicated)."""

    num_kv_heads: int = 1
    replaces = True

    def accepts(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    def check(self, module: nn.Module, name: str, tp: int) -> None:
        super().check(module, name, tp)
        module = cast(nn.Linear, module)  # accepts() lets only nn.Linear through
        check_divides(module.out_features, self.num_kv_heads, f"out_features of {name} (kv heads)")
        if not replicates_kv(self.num_kv_heads, tp):
            raise PlanError(
                f"{self} on {name!r}: tp={tp} must be a multiple of num_kv_heads={self.num_kv_heads} and larger; "
                "use ColumnParallel when tp divides the kv heads"
            )

    def apply(self, module: nn.Module, name: str, tp_group: dist.ProcessGroup | None, axis: str) -> nn.Module:
        return ReplicatedKVLinear(cast(nn.Linear, module), self.num_kv_heads, tp_group=tp_group, axis=axis)


@dataclass(frozen=True)
class RowParallel(Style):
    """``nn.Linear`` -> :class:`RowParallelLinear` (input features split)."""

    input_is_parallel: bool = True
    sequence_parallel: bool = False
    replaces = True

    def accepts(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    def check(self, module: nn.Module, name: str, tp: int) -> None:
        super().check(module, name, tp)
        module = cast(nn.Linear, module)  # accepts() lets only nn.Linear through
        check_divides(module.in_features, tp, f"in_features of {name}")

    def param_placement(self, param: str, shape: tuple[int, ...], tp: int) -> ParamLayout:
        return (Shard(1), None) if param == "weight" else (Replicate(), None)  # the bias is added after the sum

    def apply(self, module: nn.Module, name: str, tp_group: dist.ProcessGroup | None, axis: str) -> nn.Module:
        module = cast(nn.Linear, module)  # accepts() lets only nn.Linear through
        return RowParallelLinear(
            module.in_features,
            module.out_features,
            tp_group=tp_group,
            input_is_parallel=self.input_is_parallel,
            sequence_parallel=self.sequence_parallel,
            axis=axis,
            source=module,
        )


@dataclass(frozen=True)
class VocabParallel(Style):
    """Split a vocabulary, padded to a multiple of tp.

    ``nn.Embedding`` -> :class:`VocabParallelEmbedding`; ``nn.Linear`` (the
    output head) -> column parallel with padded outputs, whose logit shards
    feed :func:`vocab_parallel_cross_entropy` (pass ``vocab_size``).
    ``sequence_parallel`` on an embedding reduce-scatters its output along the
    sequence; on a head it all-gathers its sequence-sharded input.
    """

    sequence_parallel: bool = False
    gather_output: bool = False
    replaces = True

    def accepts(self, module: nn.Module) -> bool:
        return isinstance(module, (nn.Embedding, nn.Linear))

    def param_placement(self, param: str, shape: tuple[int, ...], tp: int) -> ParamLayout:
        padded = (padded_size(shape[0], tp), *shape[1:])  # vocabulary rows (embedding, head weight and bias)
        return Shard(0), (padded if padded != tuple(shape) else None)

    def apply(self, module: nn.Module, name: str, tp_group: dist.ProcessGroup | None, axis: str) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding(
                module.num_embeddings,
                module.embedding_dim,
                tp_group=tp_group,
                sequence_parallel=self.sequence_parallel,
                axis=axis,
                source=module,
            )
        module = cast(nn.Linear, module)  # accepts() lets only nn.Embedding and nn.Linear through
        return ColumnParallelLinear(
            module.in_features,
            module.out_features,
            tp_group=tp_group,
            gather_output=self.gather_output,
            sequence_parallel=self.sequence_parallel,
            pad_output=True,
            axis=axis,
            source=module,
        )


@dataclass(frozen=True)
class SequenceParallel(Style):
    """A module (LayerNorm, RMSNorm, ...) that runs on a sequence shard with replicated weights.

    Its parameters are flagged so :func:`sync_sequence_parallel_grads` sums
    their gradients over the tp group; the module itself is unchanged.
    """

    def apply(self, module: nn.Module, name: str, tp_group: dist.ProcessGroup | None, axis: str) -> nn.Module:
        for param_name, param in module.named_parameters():
            record_replicate(param, f"{name}.{param_name}", axis)
            mark_sequence_parallel(param)
        return module


@dataclass(frozen=True)
class HeadNorm(SequenceParallel):
    """A norm over each head's dims (Qwen3's q/k norm) inside attention whose heads tp splits: one
    weight entry per head dim, shared by every head, so each rank keeps the whole weight but sees only
    its own heads; its gradient is summed over tp, as a sequence-parallel norm's is (flagged alike,
    with or without sequence parallelism)."""


def _first_input(args: tuple[object, ...], name: str, style: Style) -> None:
    if not args or not isinstance(args[0], torch.Tensor):
        got = type(args[0]).__name__ if args else "no positional arguments"
        raise PlanError(f"{style} on {name!r} needs the activation as the first positional argument; got {got}")


@dataclass(frozen=True)
class TPEntry(Style):
    """Enter the tp region once at a module's first input, for the column-parallel
    layers inside it that read it (built with ``input_entered=True``).

    forward: identity (all-gather along ``sequence_dim`` with SP) /
    backward: all-reduce (reduce-scatter with SP).
    """

    sequence_parallel: bool = False
    sequence_dim: int = 1

    def apply(self, module: nn.Module, name: str, tp_group: dist.ProcessGroup | None, axis: str) -> nn.Module:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            _first_input(args, name, self)
            return (enter_region(args[0], tp_group, self.sequence_parallel, self.sequence_dim), *args[1:])

        module.register_forward_pre_hook(hook)
        return module


@dataclass(frozen=True)
class SplitSequence(Style):
    """Split a module's first input along the sequence (entering the sequence-parallel part
    where the activations are replicated, e.g. the first block after token + position embeddings).

    forward: keep this rank's piece / backward: all-gather.
    """

    sequence_dim: int = 1

    def apply(self, module: nn.Module, name: str, tp_group: dist.ProcessGroup | None, axis: str) -> nn.Module:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            _first_input(args, name, self)
            return (split_sequence(args[0], tp_group, self.sequence_dim), *args[1:])

        module.register_forward_pre_hook(hook)
        return module


HEAD_ATTRS = ("num_heads", "num_kv_heads", "n_head", "n_heads", "n_kv_heads", "num_key_value_heads")


@dataclass(frozen=True)
class ShardHeads(Style):
    """Divide the head counts an attention module reads (``num_heads``, ``num_kv_heads``, ...) by tp.

    Use with column-parallel q/k/v and a row-parallel output projection, so
    each rank runs num_heads/tp query heads and num_kv_heads/tp kv heads.
    ``replicate_kv``: tp may exceed the kv heads (a multiple of them); each rank then runs one kv
    head, and k/v must use :class:`ReplicateKVHeads`.
    """

    attrs: tuple[str, ...] = HEAD_ATTRS
    replicate_kv: bool = False

    def _present(self, module: nn.Module) -> list[str]:
        return [a for a in self.attrs if isinstance(getattr(module, a, None), int)]

    def check(self, module: nn.Module, name: str, tp: int) -> None:
        present = self._present(module)
        if not present:
            ints = [k for k, v in vars(module).items() if isinstance(v, int) and not k.startswith("_")]
            raise PlanError(f"{name!r} has none of the head-count attributes {self.attrs}; its int attributes: {ints}")
        query = getattr(module, present[0])
        for attr in present[1:]:
            heads_per_rank(query, getattr(module, attr), tp, where=name, replicate_kv=self.replicate_kv)
        heads_per_rank(query, None, tp, where=name)

    def apply(self, module: nn.Module, name: str, tp_group: dist.ProcessGroup | None, axis: str) -> nn.Module:
        for attr in self._present(module):  # a kv head count below tp: one (replicated) kv head per rank
            setattr(module, attr, max(1, getattr(module, attr) // tp_size(tp_group)))
        return module


@dataclass(frozen=True)
class HeadParameter(Style):
    """A parameter of an attention module with one entry per query head along dim 0 (gpt-oss's
    ``sinks``, (N,)), split with the heads: with :class:`ShardHeads` and column-parallel q, tp rank r
    runs query heads [r N/tp, (r + 1) N/tp), so it keeps those entries. Each rank's gradient is then
    whole for its heads: no collective."""

    name: str = "sinks"

    def check(self, module: nn.Module, name: str, tp: int) -> None:
        param = getattr(module, self.name, None)
        if not isinstance(param, nn.Parameter):
            raise PlanError(f"{self} expects {name!r} to hold a parameter {self.name!r}; it has none")
        check_divides(param.shape[0], tp, f"{name}.{self.name} (one entry per query head)")

    def param_placement(self, param: str, shape: tuple[int, ...], tp: int) -> ParamLayout:
        return (Shard(0), None) if param == self.name else (Replicate(), None)

    def apply(self, module: nn.Module, name: str, tp_group: dist.ProcessGroup | None, axis: str) -> nn.Module:
        full = getattr(module, self.name)
        piece = full.detach().chunk(tp_size(tp_group))[dist.get_rank(tp_group)].clone()
        local = nn.Parameter(piece, requires_grad=full.requires_grad)
        setattr(module, self.name, local)
        record_shard(local, f"{name}.{self.name}", tuple(full.shape), 0, axis)
        return module
