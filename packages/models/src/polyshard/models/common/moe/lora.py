"""LoRA on the routed experts themselves (``lora.experts``): one rank-r adapter per expert and weight,
stacked like the experts' weights so that expert parallelism's one slice on dim 0 holds its experts'
adapters too.

    W_e (K, M) frozen  ->  x W_e + scale * (x A_e) B_e        A: (E, K, r), B: (E, r, M)

The factors are stored in the experts' own orientation (a weight is (E, in, out), the transpose of an
``nn.Linear``'s), so the forward is the layer's grouped matmul run twice, r wide
(:meth:`GroupedExperts._project`), and merging is ``W + scale * A @ B``. Each expert's A is PEFT's
Kaiming-uniform of its (r, in) factor, drawn from the run's seed and the expert's global index (so every
ep layout draws the same numbers), B is zero: the first forward equals the base's.

Attached after :func:`polyshard.ep.apply_expert_parallel`: a rank draws only its own experts' adapters,
and each factor takes its base weight's placement record (``Shard(0)`` over ep) under its own name, and
its sequence-parallel flag (the experts see a tp rank's sequence shard, so their gradients are summed
over tp as the base's would be). The experts are never split by tp (ep splits them), so neither are
their adapters.

Shapes: E experts (E_local on this rank), K a weight's in features, M its out features, r the rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from polyshard.mesh import get_placement, set_placement
from polyshard.models.common.lora import EXPERT_ADAPTER_SUFFIXES, initial_a, is_expert_adapter, lora_scale
from polyshard.models.common.moe.layer import MoELayer
from polyshard.models.errors import ConfigError
from polyshard.tp.shard import is_sequence_parallel, mark_sequence_parallel

EXPERT_WEIGHTS = ("w1", "w3", "w2")
"""The stacked matrices an expert may have (gate, up, down; gelu experts have no ``w3``)."""


def expert_adapter_shapes(
    layer_name: str, weights: dict[str, tuple[int, ...]], rank: int
) -> dict[str, tuple[int, ...]]:
    """The global shapes of the factors beside each stacked weight ``weights`` (name -> (E, K, M)) of the MoE
    layer ``layer_name``: ``w_lora_A`` (E, K, r) and ``w_lora_B`` (E, r, M)."""
    out: dict[str, tuple[int, ...]] = {}
    for weight, (experts, fan_in, fan_out) in weights.items():
        out[f"{layer_name}.experts.{weight}_lora_A"] = (experts, fan_in, rank)
        out[f"{layer_name}.experts.{weight}_lora_B"] = (experts, rank, fan_out)
    return out


def attach_expert_lora(
    layer: MoELayer,
    name: str,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    rslora: bool,
    seed: int,
) -> int:
    """Freeze ``layer``'s experts (the MoE layer ``name``) and give each of their stacked weights a rank-``rank``
    adapter per expert, this rank's experts only; returns how many weights were adapted."""
    experts = layer.experts
    ep_rank = dist.get_rank(layer.ep_group) if layer.ep_group is not None else 0
    adapted = 0
    for weight in EXPERT_WEIGHTS:
        base = getattr(experts, weight, None)
        if base is None:
            continue
        local, fan_in, fan_out = base.shape
        if rank > min(fan_in, fan_out):
            raise ConfigError(
                f"lora.rank={rank} is larger than {name}.experts.{weight} ({fan_in} x {fan_out} per expert) "
                f"with lora.experts = true; choose rank <= {min(fan_in, fan_out)} or lora.experts = false"
            )
        first = ep_rank * local  # this rank's experts are [first, first + local) of the E
        full_name = f"{name}.experts.{weight}"
        a = torch.stack([initial_a(rank, fan_in, seed, f"{full_name}.{first + e}").T for e in range(local)])
        factors = (a, torch.zeros(local, rank, fan_out))  # (E_local, K, r), (E_local, r, M)
        for suffix, value in zip(EXPERT_ADAPTER_SUFFIXES, factors, strict=True):
            param = nn.Parameter(value.to(base.device, base.dtype).contiguous())
            _follow(param, base, suffix)
            experts.register_parameter(f"{weight}{suffix}", param)
        adapted += 1
    for own, param in experts.named_parameters(recurse=False):  # the base frozen, its adapters trained
        param.requires_grad_(is_expert_adapter(f"experts.{own}"))
    experts.lora_scale = lora_scale(rank, alpha, rslora)
    experts.lora_dropout = nn.Dropout(dropout)
    return adapted


def _follow(param: nn.Parameter, base: torch.Tensor, suffix: str) -> None:
    """Give the factor its base weight's placement (split over ep on dim 0 like it) under its own name and
    global shape, and its sequence-parallel flag."""
    record = get_placement(base)
    if record is not None:
        shape = (record.global_shape[0], *param.shape[1:])
        record = dataclasses.replace(record, name=f"{record.name}{suffix}", global_shape=shape, padded_shape=None)
        set_placement(param, record)
    if is_sequence_parallel(base):
        mark_sequence_parallel(param)


def merge_expert_adapters(state: dict[str, torch.Tensor], scale: float) -> None:
    """Fold every expert adapter of the whole (unsharded) ``state`` into its weight, in place:
    ``W + scale * A @ B`` per expert, (E, K, r) @ (E, r, M) -> (E, K, M), and drop the factors."""
    for name in [n for n in state if n.endswith(EXPERT_ADAPTER_SUFFIXES[0]) and is_expert_adapter(n)]:
        weight = name.removesuffix(EXPERT_ADAPTER_SUFFIXES[0])
        a, b = state.pop(name), state.pop(f"{weight}{EXPERT_ADAPTER_SUFFIXES[1]}")
        base = state[weight]
        state[weight] = (base.float() + scale * torch.bmm(a.float(), b.float())).to(base.dtype)
