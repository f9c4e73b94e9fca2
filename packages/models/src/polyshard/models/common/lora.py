"""LoRA (Hu et al., 2106.09685): a frozen linear plus a trainable low-rank update, initialised as PEFT does.

    y = base(x) + scale * B(A(dropout(x)))      A: (r, I), B: (O, r), scale = alpha / r (alpha / sqrt(r): rsLoRA)

A is Kaiming-uniform with a = sqrt(5) (``nn.Linear``'s own rule, PEFT's default) and B is zero, so the
first forward equals the base model's. The adapter hangs off the linear it adapts, as ``<linear>.lora_A``
and ``<linear>.lora_B`` beside the base's ``weight``, and a forward hook adds its update: the base keeps its
name (checkpoints, ``--init-from``, Hugging Face files) and only its ``requires_grad`` changes (False), so
dp's buckets, ZeRO's shards and the optimizer, which take trainable parameters only, see the adapters alone.

Tensor parallelism (the adapter is attached after :func:`polyshard.tp.parallelize` converted the base):

* column-parallel base (q/k/v, gate/up): A replicated, B split by rows like the base's weight, so each
  rank adds its own output columns. The input gradient of A's output is partial over tp (each rank sees
  its columns): when the base's input was entered upstream (``input_entered``, attention's q/k/v) that
  entry's all-reduce sums the adapter's share of the input gradient with the base's, and A's gradient is
  summed over tp once per step (flagged as a sequence-parallel norm's is); otherwise the r-wide ``A x``
  enters the tp region itself (identity forward, all-reduce of an (B, S, r) gradient backward; all-gather
  and reduce-scatter along the sequence with SP, where A's gradient is then summed over tp too).
* row-parallel base (o, down): A split by columns like the base's weight, B replicated; the r-wide
  partial ``A_local x_local`` leaves the region (all-reduce, or reduce-scatter with SP) and B adds its
  update to the base's reduced output; with SP, B sees a sequence shard and its gradient is summed over tp.

Shapes: B batch, S sequence, I in features, O out features, r the rank, tp the tensor-parallel size.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, cast

import torch
from torch import nn

from polyshard.models.errors import ConfigError
from polyshard.tp import ColumnParallelLinear, RowParallelLinear, enter_region, leave_region
from polyshard.tp.shard import mark_sequence_parallel, record_replicate, record_shard, take_shard

ADAPTER_PARTS = ("lora_A", "lora_B")
"""The names the two factors take under the adapted linear (PEFT's, without its adapter name)."""


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA factor's (``...q_proj.lora_A.weight``)."""
    return any(f".{part}." in f".{name}" for part in ADAPTER_PARTS)


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
    linear.register_forward_hook(_add_update)


def _record(linear: nn.Module, a: nn.Parameter, b: nn.Parameter, rank: int, out_features: int) -> None:
    """The factors' placements over tp, and which gradients are partial over tp (summed once per step)."""
    if isinstance(linear, ColumnParallelLinear):
        record_replicate(a, "lora_A.weight", linear.axis)
        record_shard(b, "lora_B.weight", (out_features, rank), 0, linear.axis)
        if linear.input_entered or linear.sequence_parallel:
            mark_sequence_parallel(a)
    elif isinstance(linear, RowParallelLinear):
        record_shard(a, "lora_A.weight", (rank, linear.in_features), 1, linear.axis)
        record_replicate(b, "lora_B.weight", linear.axis)
        if linear.sequence_parallel:
            mark_sequence_parallel(b)


def _add_update(linear: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    a, b, dropout = (cast(nn.Module, getattr(linear, part)) for part in ("lora_A", "lora_B", "lora_dropout"))
    x = dropout(args[0])
    h = a(x)  # (B, S, I) -> (B, S, r); (B, S, I/tp) -> partial (B, S, r) under a row-parallel base
    if isinstance(linear, ColumnParallelLinear) and not linear.input_entered:
        h = enter_region(h, linear.tp_group, linear.sequence_parallel, linear.sequence_dim)
    elif isinstance(linear, RowParallelLinear):
        h = leave_region(h, linear.tp_group, linear.sequence_parallel, linear.sequence_dim)
    update: torch.Tensor = b(h) * getattr(linear, "lora_scale")  # noqa: B009  # (B, S, r) -> (B, S, O) or (B, S, O/tp)
    return output + update


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable factors of every adapter in ``model``, by name."""
    return {name: p for name, p in model.named_parameters() if is_adapter(name)}
