"""Measured memory, to hold the planner's estimates against.

:class:`SavedTensorMeter` counts the bytes autograd saves for backward while a step runs, through
``torch.autograd.graph.saved_tensors_hooks``: each saved tensor's storage is counted once while
any saved reference to it lives (views share a storage), parameters are left out (they are model
states, not activations), and the peak is kept. It measures activations the same way on CPU and
GPU, which the process's peak memory (max RSS on CPU) cannot: RSS also holds the interpreter,
libraries and every allocator cache. It does not see inside activation-checkpointed blocks, whose
own hooks take over.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from polyshard.dp import bytes_held


class _Saved:
    """One saved reference; when autograd drops it, its storage's count goes down."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedTensorMeter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """``with SavedTensorMeter(params) as meter: step()`` then ``meter.peak`` (bytes)."""

    def __init__(self, parameters: Iterable[nn.Parameter] = ()):
        self._params = {p.untyped_storage().data_ptr() for p in parameters}
        self._live: dict[int, list[int]] = {}  # storage -> [bytes, saved references]
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if isinstance(tensor, nn.Parameter) or key in self._params or storage.nbytes() == 0:
            return tensor
        entry = self._live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def model_state_bytes_held(engine: Any) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes this rank's engine holds now (call at the optimizer step)."""
    totals = [0, 0, 0]
    for (_, wrapper), optimizer in zip(sorted(engine.wrappers.items()), engine.optimizers):
        report = bytes_held(wrapper, optimizer)
        for i, value in enumerate((report.params, report.grads, report.optimizer_state)):
            totals[i] += value
    return totals[0], totals[1], totals[2]
