"""Saving while training continues: a copy to host memory at the step boundary, the files written,
hashed and published by a background thread.

:meth:`BackgroundSaver.save` blocks only for the copy: every tensor of the rank's state is copied to
CPU memory (what the optimizer changes next cannot reach it), then a thread runs
:func:`~polyshard.checkpoint.save.save_checkpoint` on the copy. The save's barriers and gather run
on a process group of its own (gloo, made once by every rank in the same order), so they never
interleave with the training's collectives on the main thread's groups. A save waits for the one
before it, and :meth:`BackgroundSaver.wait` (the run's end) for the last. Publishing is the same
atomic rename as a blocking save: a process killed mid-write leaves a temporary folder, and the
previous checkpoint stays the newest complete one. An error in the thread is raised by the next
``save`` or ``wait``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from polyshard.checkpoint.save import LocalTensor, save_checkpoint


def host_copy(tensors: Mapping[str, LocalTensor]) -> dict[str, LocalTensor]:
    """Every tensor copied to CPU memory (pinned from a GPU, so the copies overlap), placements kept."""
    pinned = any(t.tensor.is_cuda for t in tensors.values())
    copies = {}
    for name, t in tensors.items():
        host = torch.empty(t.tensor.shape, dtype=t.tensor.dtype, pin_memory=pinned and t.tensor.is_cuda)
        host.copy_(t.tensor.detach(), non_blocking=pinned)
        copies[name] = LocalTensor(host, t.placement)
    if pinned:
        torch.cuda.synchronize()  # the copies are complete before the optimizer changes the originals
    return copies


class BackgroundSaver:
    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last: Path | None = None

    def save(
        self,
        root: str | Path,
        step: int,
        tensors: Mapping[str, LocalTensor],
        *,
        after_publish: Callable[[Path], None] | None = None,
        **options: Any,
    ) -> None:
        """Copy ``tensors`` to host memory and save them in the background (the options are
        :func:`save_checkpoint`'s); ``after_publish(folder)`` runs in the thread once it is published."""
        self.wait()
        copies = host_copy(tensors)

        def run() -> None:
            try:
                folder = save_checkpoint(root, step, copies, group=self.group, copy=False, **options)
                self._last = folder
                if after_publish is not None:
                    after_publish(folder)
            except BaseException as err:  # re-raised on the main thread by wait()
                self._error = err

        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        """Until the save in flight is published; its folder (None if none was made). Re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._last
