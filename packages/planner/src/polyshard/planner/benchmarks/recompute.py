"""Benchmark (not a test): activation checkpointing none, selective and full, side by side.

    polyshard bench recompute --preset small --batch 8

For each mode, one process: the bytes one transformer block keeps for backward (measured, and the
planner's figure), and the median time of a forward + backward of the whole model. Selective should
keep less than none and time less than full (it skips the matmuls full recomputes).

Bytes kept are counted two ways at once, each storage once, parameters left out: the tensors autograd
saves (``torch.autograd.graph.saved_tensors_hooks``, which sees the block's input that checkpointing
keeps) and the tensors made during the forward that are still alive after it (a ``TorchDispatchMode``
noting each op's outputs by storage), which sees what selective checkpointing caches: its matmul
outputs live in ``torch.utils.checkpoint``'s own cache, not in autograd's saved tensors.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from polyshard.models import build_model, output_width, sequence_length
from polyshard.planner.activations import stage_bytes
from polyshard.trainer.config import Config, from_dict

MODES: tuple[bool | str, ...] = (False, "selective", "full")


class _Outputs(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes the storage of every op's outputs (a new storage at a freed one's address replaces it)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                known = self.made.get(storage.data_ptr())
                if known is None or known[0].expired():  # type: ignore[no-untyped-call]
                    self.made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())  # type: ignore[no-untyped-call]
        return out


def held_bytes(fn: Callable[[], torch.Tensor], parameters: Iterable[torch.Tensor] = ()) -> int:
    """Bytes ``fn()``'s forward leaves held for backward, each storage once: what autograd saved and what
    the forward made that is still alive, less ``parameters`` and the output itself."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    outputs = _Outputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), outputs:
        out = fn()
    alive = {ptr: nbytes for ptr, (ref, nbytes) in outputs.made.items() if not ref.expired()}  # type: ignore[no-untyped-call]
    held = {**saved, **alive}
    for t in (*parameters, out):
        held.pop(t.untyped_storage().data_ptr(), None)
    return sum(held.values())


def _config(preset: str, mode: bool | str, batch: int, precision: str, **model: Any) -> Config:
    training = {"global_batch_size": batch, "activation_checkpointing": mode, "precision": precision}
    return from_dict({"model": {"preset": preset, **model}, "training": training})


def block_bytes(config: Config) -> tuple[int, float]:
    """(measured, planned) bytes one block keeps for backward on one process, a batch of
    ``training.global_batch_size`` rows of the full context."""
    model = build_model(config.model, checkpoint_activations=config.training.activation_checkpointing)
    block = cast(nn.ModuleList, model.layers)[1]
    batch, seq = config.training.global_batch_size, sequence_length(config.model)
    x = torch.randn(batch, seq, config.model.hidden, requires_grad=True)
    bf16 = config.training.precision == "bf16"

    def forward() -> torch.Tensor:  # autocast ends inside: its cache of bf16 weights is not activations
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return cast(torch.Tensor, block(x))

    forward().sum().backward()  # once first: caches (rope frequencies) are made outside the count
    measured = held_bytes(forward, block.parameters())
    planned = stage_bytes(config, range(1, 2), batch)
    return measured, planned


def _step(model: nn.Module, tokens: torch.Tensor, bf16: bool) -> tuple[float, float]:
    """Wall and CPU seconds (this process's threads) of one forward + backward of ``model`` on ``tokens``."""
    start, cpu = time.perf_counter(), time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - cpu


def step_ms(configs: list[Config], repeats: int = 5) -> list[tuple[float, float]]:
    """Median (wall, CPU) milliseconds of one forward + backward of each config's whole model on one batch.
    The modes take turns step by step, so a change in the machine's load falls on all of them alike; the
    CPU time (what this process's threads ran) is the steadier figure on a machine other jobs share."""
    models = []
    for config in configs:
        torch.manual_seed(0)
        models.append(build_model(config.model, checkpoint_activations=config.training.activation_checkpointing))
    first = configs[0]
    batch, seq = first.training.global_batch_size, sequence_length(first.model)
    tokens = torch.randint(0, output_width(first.model), (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    bf16 = first.training.precision == "bf16"
    times: list[list[tuple[float, float]]] = [[] for _ in configs]
    for repeat in range(repeats + 1):  # the first round is a warm-up
        for model, kept in zip(models, times, strict=True):
            seconds = _step(model, tokens, bf16)
            if repeat:
                kept.append(seconds)
    return [(statistics.median(w for w, _ in t) * 1e3, statistics.median(c for _, c in t) * 1e3) for t in times]


def run(preset: str, batch: int, precision: str = "fp32", repeats: int = 5, **model: Any) -> list[dict[str, object]]:
    """One record per mode: measured and planned bytes per block, and the step time."""
    configs = [_config(preset, mode, batch, precision, **model) for mode in MODES]
    records: list[dict[str, object]] = []
    for mode, config, (wall, cpu) in zip(MODES, configs, step_ms(configs, repeats), strict=True):
        measured, planned = block_bytes(config)
        records.append({"mode": mode or "none", "block_bytes": measured, "planned_bytes": planned,
                        "step_ms": wall, "step_cpu_ms": cpu})  # fmt: skip
    return records


def report(records: list[dict[str, object]]) -> str:
    lines = [f"{'mode':<10} {'kept/block MiB':>14} {'planner MiB':>12} {'ratio':>6} {'step ms':>9} {'CPU ms':>9}"]
    for r in records:
        measured, planned = float(r["block_bytes"]), float(r["planned_bytes"])  # type: ignore[arg-type]
        wall, cpu = float(r["step_ms"]), float(r["step_cpu_ms"])  # type: ignore[arg-type]
        lines.append(f"{r['mode']!s:<10} {measured / 2**20:>14.2f} {planned / 2**20:>12.2f} "
                     f"{measured / planned:>6.2f} {wall:>9.1f} {cpu:>9.1f}")  # fmt: skip
    return "\n".join(lines)
