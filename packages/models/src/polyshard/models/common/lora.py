"""LoRA (Hu et al., 2106.09685): a frozen linear plus a trainable low-rank update, initialised as PEFT does.

    y = base(x) + scale * B(A(dropout(x)))      A: (r, I), B: (O, r), scale = alpha / r (alpha / sqrt(r): rsLoRA)

A is Kaiming-uniform with a = sqrt(5) (``nn.Linear``'s own rule, PEFT's default) and B is zero, so the
first forward equals the base model's. The adapter hangs off the linear it adapts, as ``<linear>.lora_A``
and ``<linear>.lora_B`` beside the base's ``weight``, and a forward hook adds its update: the base keeps its
name (checkpoints, ``--init-from``, Hugging Face files) and only its ``requires_grad`` changes (False), so
dp's buckets, ZeRO's shards and the optimizer, which take trainable parameters only, see the adapters alone.

Tensor parallelism (the adapter is attached after :func:`polyshard.tp.parallelize` converted the base)
adds no collective to the forward or backward: each adapter rides on its base's.

* column-parallel base (q/k/v, gate/up): A replicated, B split by rows like the base's weight, so each
  rank adds its own output columns. A reads the base's *entered* input (attention's q/k/v share one
  entry upstream; gate/up get theirs in front of them, :func:`_enter_before`), so the entry's backward
  all-reduce (reduce-scatter with SP) sums the adapter's share of the input gradient with the base's.
  A's gradient, each rank's from its own columns, is summed over tp once per step (flagged as a
  sequence-parallel norm's is, so it joins that one coalesced all-reduce).
* row-parallel base (o, down): A split by columns like the base's weight, B replicated; the adapter's
  partial product B A_local x_local joins the base's partial sums before their one reduction
  (``RowParallelLinear.partial_addend``); B's gradient, partial over tp, is summed once per step too.

Shapes: B batch, S sequence, I in features, O out features, r the rank, tp the tensor-parallel size.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any, cast

import torch
from torch import nn

from polyshard.models.errors import ConfigError
from polyshard.tp import ColumnParallelLinear, RowParallelLinear, enter_region
from polyshard.tp.shard import mark_sequence_parallel, record_replicate, record_shard, take_shard

ADAPTER_PARTS = ("lora_A", "lora_B")
"""The names the two factors take under the adapted linear (PEFT's, without its adapter name)."""


EXPERT_ADAPTER_SUFFIXES = ("_lora_A", "_lora_B")
"""What a routed expert weight's two factors append to its name (``experts.w1`` -> ``experts.w1_lora_A``:
:mod:`polyshard.models.common.moe.lora`); they stay beside the weight so that ep shards them with it."""


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA factor's: a linear's (``...q_proj.lora_A.weight``) or the routed
    experts' (``...moe.experts.w1_lora_A``)."""
    return any(f".{part}." in f".{name}" for part in ADAPTER_PARTS) or is_expert_adapter(name)


def is_expert_adapter(name: str) -> bool:
    """Whether a parameter name is a factor of the routed experts' adapters (``...moe.experts.w1_lora_A``)."""
    return name.endswith(EXPERT_ADAPTER_SUFFIXES) and ".experts." in f".{name}"


def lora_scale(rank: int, alpha: float, rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA (Kalajdzievski, 2312.03732)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def initial_a(rank: int, in_features: int, seed: int, name: str) -> torch.Tensor:
    """The whole (r, I) A of the linear ``name``: Kaiming-uniform with a = sqrt(5), drawn from a generator
    seeded by ``seed`` and the name, so every layout (any tp, any pipeline stage) draws the same numbers."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    weight = torch.empty(rank, in_features)
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6) * sqrt(3 / fan_in)
    return weight.uniform_(-bound, bound, generator=generator)


def attach_lora(
    linear: nn.Module,
    name: str,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    rslora: bool,
    seed: int,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Freeze ``linear`` (an ``nn.Linear``, or one tp converted) and hang a rank-``rank`` adapter off it:
    PEFT's initialisation, or ``initial``'s whole A (r, I) and B (O, r) (an adapter read from a file)."""
    if not isinstance(linear, (nn.Linear, ColumnParallelLinear, RowParallelLinear)):
        raise ConfigError(
            f"lora.targets: {name} is a {type(linear).__name__}, which LoRA does not adapt under this layout "
            "(k/v replicated over more tp ranks than kv heads); drop k_proj/v_proj from lora.targets or lower tp"
        )
    in_features, out_features = linear.in_features, linear.out_features
    if rank > min(in_features, out_features):
        raise ConfigError(
            f"lora.rank={rank} is larger than {name} ({out_features} x {in_features}); choose rank <= "
            f"{min(in_features, out_features)}"
        )
    weight = linear.weight
    full_a = initial_a(rank, in_features, seed, name) if initial is None else initial[0]
    full_a = full_a.to(weight.device, weight.dtype)
    full_b = torch.zeros(out_features, rank) if initial is None else initial[1]
    full_b = full_b.to(weight.device, weight.dtype)
    if isinstance(linear, ColumnParallelLinear) and linear.gather_output:
        raise ConfigError(f"lora.targets: {name} gathers its output (an output head); LoRA adapts inner linears")
    if isinstance(linear, RowParallelLinear) and not linear.input_is_parallel:
        raise ConfigError(
            f"lora.targets: {name} splits its own input under tp; LoRA adapts row-parallel linears fed a split input"
        )
    local_a, local_b = full_a, full_b
    if isinstance(linear, RowParallelLinear):
        local_a = take_shard(full_a, 1, linear.tp_group)  # the base's columns: (r, I/tp)
    elif isinstance(linear, ColumnParallelLinear):
        local_b = take_shard(full_b, 0, linear.tp_group)  # the base's rows: (O/tp, r)
    for param in linear.parameters(recurse=False):
        param.requires_grad_(False)
    a = nn.Linear(local_a.shape[1], rank, bias=False, device=weight.device, dtype=weight.dtype)
    b = nn.Linear(rank, local_b.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        a.weight.copy_(local_a)
        b.weight.copy_(local_b)
    linear.add_module("lora_A", a)
    linear.add_module("lora_B", b)
    linear.add_module("lora_dropout", nn.Dropout(dropout))
    setattr(linear, "lora_scale", lora_scale(rank, alpha, rslora))  # noqa: B010  (a float beside the modules)
    _record(linear, cast(nn.Parameter, a.weight), cast(nn.Parameter, b.weight), rank, out_features)
    if isinstance(linear, RowParallelLinear):
        linear.partial_addend = functools.partial(_update, linear)  # reduced with the base's partial sums
        return
    if isinstance(linear, ColumnParallelLinear) and not linear.input_entered:
        _enter_before(linear)
    linear.register_forward_hook(_add_update)


def _enter_before(linear: ColumnParallelLinear) -> None:
    """Enter the tp region in front of ``linear`` instead of inside it, so its adapter reads the entered
    input too and the entry's backward sums both input gradients at once. The base is frozen, so the
    entry had no weight gradient to overlap its reduction with; its SP memory options go with it."""
    linear.input_entered, linear.regather_input, linear.overlap_forward_gather = True, False, False

    def enter(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = enter_region(args[0], linear.tp_group, linear.sequence_parallel, linear.sequence_dim)
        return (x, *args[1:])

    linear.register_forward_pre_hook(enter)


def _record(linear: nn.Module, a: nn.Parameter, b: nn.Parameter, rank: int, out_features: int) -> None:
    """The factors' placements over tp, and the factor whose gradient is partial over tp (summed once per
    step, as a sequence-parallel norm's): A beside a column-parallel base (each rank backpropagates its
    own output columns into it), B beside a row-parallel one (each rank's A x holds its input columns)."""
    if isinstance(linear, ColumnParallelLinear):
        record_replicate(a, "lora_A.weight", linear.axis)
        record_shard(b, "lora_B.weight", (out_features, rank), 0, linear.axis)
        mark_sequence_parallel(a)
    elif isinstance(linear, RowParallelLinear):
        record_shard(a, "lora_A.weight", (rank, linear.in_features), 1, linear.axis)
        record_replicate(b, "lora_B.weight", linear.axis)
        mark_sequence_parallel(b)


def _update(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """scale * B A dropout(x): (B, S, I) -> (B, S, O); this rank's O/tp columns beside a column-parallel
    base, partial sums beside a row-parallel one (its I/tp input columns)."""
    a, b, dropout = (cast(nn.Module, getattr(linear, part)) for part in ("lora_A", "lora_B", "lora_dropout"))
    x = x.to(cast(nn.Linear, a).weight.dtype)  # a base kept in bf16 (model.frozen_dtype) reads bf16 inputs
    update: torch.Tensor = b(a(dropout(x))) * getattr(linear, "lora_scale")  # noqa: B009
    return update


def _add_update(linear: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    return output + _update(linear, args[0])


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable factors of every adapter in ``model``, by name."""
    return {name: p for name, p in model.named_parameters() if is_adapter(name)}
