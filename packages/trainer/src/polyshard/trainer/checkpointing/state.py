"""What a rank saves and restores: its parameters, optimizer state, RNG and data position.

Tensor keys follow :mod:`polyshard.checkpoint.format` (``model/<name>``,
``optim/<name>/<state>``, ``rng/torch``). A model's persistent buffers (a sigmoid router's
selection bias) are saved beside its parameters under ``model/<name>``: replicated state, one
copy per layer, so the plain model's ``load_state_dict(strict=True)`` finds them in an export.
Each carries its placement record into the checkpoint index. Restoring into
the same layout is exact: on CPU a resumed run's losses equal an
uninterrupted run's bit for bit. Restoring into another layout goes through
:mod:`polyshard.trainer.checkpointing.run_reshard`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from polyshard.checkpoint import MASTER, RNG, CheckpointError, LocalTensor, model_key, optim_key
from polyshard.dp import MOMENTUM, FullyShardedDataParallel, Muon, ZeroOptimizer
from polyshard.mesh import TensorPlacement, get_placement
from polyshard.models import layer_of
from polyshard.models.common.lora import is_adapter
from polyshard.trainer.engine.engine import Engine


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers ``module.state_dict()`` holds (not the non-persistent ones), by name."""
    for prefix, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buffer


def _buffers(engine: Engine, index: int) -> dict[str, torch.Tensor]:
    """Global name -> a stage's persistent buffer (whole on every rank: replicated state)."""
    out = {}
    for local, buffer in persistent_buffers(engine.stages[index]):
        position, _, rest = local.partition(".")
        out[f"layers.{engine.layer_ids[index][int(position)]}.{rest}"] = buffer
    return out


def buffer_record(name: str, buffer: torch.Tensor) -> TensorPlacement:
    """A buffer's record: the whole tensor on every rank (replicated over every axis), in its layer."""
    return TensorPlacement(name, tuple(buffer.shape), layer=layer_of(name))


def _model_tensors(engine: Engine, index: int) -> dict[str, nn.Parameter | torch.Tensor]:
    """Global name -> this rank's tensor for a stage's parameters (ZeRO-3: this rank's rows)."""
    names = engine.global_names(index)
    if engine.config.parallel.zero_stage == 3:
        # ZeRO-3's wrappers are FullyShardedDataParallel.
        shards = cast(FullyShardedDataParallel, engine.wrappers[index]).local_shards()
        # ZeRO-3 shards trainable parameters; a frozen one (LoRA's base) stays whole on each rank.
        frozen = {n: p for n, p in engine.stages[index].named_parameters() if not p.requires_grad}
        return {names[n]: v for n, v in (frozen | shards).items()}
    return {names[n]: p for n, p in engine.stages[index].named_parameters()}


def optimizer_entries(
    engine: Engine,
) -> Iterator[tuple[str, nn.Parameter, torch.optim.Optimizer, nn.Parameter | None]]:
    """(global name, the tensor the optimizer steps, its inner optimizer, master or None) per parameter."""
    for index, optimizer in zip(engine.wrappers, engine.optimizers):
        names = engine.global_names(index)
        by_id = {id(p): names[n] for n, p in engine.stages[index].named_parameters()}
        if isinstance(optimizer, ZeroOptimizer):
            for param_id, master in optimizer.masters.items():
                yield by_id[param_id], master, optimizer.optimizer, master
        else:
            for n, p in engine.stages[index].named_parameters():
                yield names[n], p, optimizer, None


def state_tensors(engine: Engine, *, base: bool = True) -> dict[str, LocalTensor]:
    """This rank's tensors by checkpoint key. ``base=False``: of the parameters, a LoRA run's adapters
    alone (every other one is its frozen base, which its checkpoints name instead: :mod:`.lora_base`);
    buffers stay, state that may move without a gradient (a sigmoid router's bias)."""
    out = {}
    for index in engine.stages:
        for name, tensor in _model_tensors(engine, index).items():
            if base or is_adapter(name):
                out[model_key(name)] = LocalTensor(tensor.detach(), get_placement(tensor))
        for name, buffer in _buffers(engine, index).items():
            out[model_key(name)] = LocalTensor(buffer, buffer_record(name, buffer))
    for name, stepped, optimizer, master in optimizer_entries(engine):
        if master is not None:
            out[optim_key(name, MASTER)] = LocalTensor(master.detach(), get_placement(master))
        for key, value in optimizer.state.get(stepped, {}).items():
            # A plain AdamW's moments have no record of their own: they are laid out like the parameter.
            record = (get_placement(value) or get_placement(stepped)) if value.dim() else None
            out[optim_key(name, key)] = LocalTensor(value.detach(), record)
    out[RNG] = LocalTensor(torch.get_rng_state())
    return out


ADAMW_STATE = {"step", "exp_avg", "exp_avg_sq"}


def _check_state_keys(
    engine: Engine, name: str, optimizer: torch.optim.Optimizer, stepped: torch.Tensor, saved: set[str]
) -> None:
    """A checkpoint's optimizer state must be the kind this run's optimizer keeps for ``name`` (AdamW's
    moments, or Muon's momentum buffer): a run saved with one ``optimizer.name`` does not resume
    with the other."""
    expected = ADAMW_STATE
    if isinstance(optimizer, Muon) and optimizer.orthogonalises(stepped):
        expected = {MOMENTUM}
    if saved and saved != expected:
        raise CheckpointError(
            f"the checkpoint holds optimizer state {sorted(saved)} for {name!r}, but "
            f"optimizer.name={engine.config.optimizer.name!r} keeps {sorted(expected)} for it; resume with "
            "the optimizer the checkpoint was saved with (its config.json says which)"
        )


@torch.no_grad()
def load_state_tensors(engine: Engine, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors laid out for this rank of ``engine`` into it: parameters, optimizer state, RNG.

    :func:`polyshard.trainer.checkpointing.run_reshard.load_into` cuts them from a checkpoint of any layout.
    """
    for index in engine.stages:
        for name, tensor in (_model_tensors(engine, index) | _buffers(engine, index)).items():
            tensor.copy_(tensors[model_key(name)])
    for name, stepped, optimizer, master in optimizer_entries(engine):
        if master is not None and optim_key(name, MASTER) in tensors:  # absent: a load of weights only
            master.copy_(tensors[optim_key(name, MASTER)])
        prefix = optim_key(name, "")
        keys = [k for k in tensors if k.startswith(prefix) and k != optim_key(name, MASTER)]
        # Moments live on the parameter's device; AdamW keeps its step counter on the CPU.
        state = {k[len(prefix) :]: tensors[k].to(stepped.device if tensors[k].dim() else "cpu") for k in keys}
        _check_state_keys(engine, name, optimizer, stepped, set(state))
        if state:
            optimizer.state[stepped] = state
    if RNG in tensors:
        torch.set_rng_state(tensors[RNG])
