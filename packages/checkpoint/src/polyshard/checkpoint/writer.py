"""A safetensors file written tensor by tensor, block by block, hashed as it goes.

The format (https://github.com/huggingface/safetensors, "Format") is an 8-byte little-endian
header length, a JSON header naming each tensor's dtype, shape and byte range, then the raw
bytes in that order. Since every shape is known up front the header is written first and the
data follows, never held whole: reshard and export hold one block at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from polyshard.checkpoint.format import DTYPE_NAMES, CheckpointError


class StreamWriter:
    """Writes one safetensors file; ``specs`` is every tensor's (dtype, shape) in file order."""

    def __init__(
        self,
        path: Path,
        specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
    ):
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self.order = list(specs)
        self.sizes: dict[str, int] = {}
        for key in self.order:
            dtype, shape = specs[key]
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.sizes[key] = size
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.data_bytes = offset
        self.digest = hashlib.sha256()
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._put(struct.pack("<Q", len(text)) + text)
        self.position, self.written = 0, 0
        self.current: str | None = None

    def _put(self, data: bytes | memoryview) -> None:
        self.file.write(data)
        self.digest.update(data)

    def write(self, key: str, block: torch.Tensor) -> None:
        """The next rows of ``key`` (tensors in the order of ``specs``, each in row order)."""
        if key != self.current:
            self._check_complete()
            while (
                self.position < len(self.order)
                and self.order[self.position] != key
                and not self.sizes[self.order[self.position]]
            ):
                self.position += 1  # an empty tensor has no blocks: its header entry is all it needs
            if self.position >= len(self.order) or self.order[self.position] != key:
                raise CheckpointError(f"internal: {key!r} written out of order")
            self.position += 1
            self.current, self.written = key, 0
        # The block's own bytes, without a copy: written and hashed through the buffer protocol.
        data = block.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
        self.written += data.nbytes
        self._put(data)

    def _next_size(self) -> int:
        return self.sizes[self.order[self.position]]

    def _check_complete(self) -> None:
        if self.current is not None and self.written != self.sizes[self.current]:
            raise CheckpointError(f"internal: {self.current!r} written incompletely")

    def close(self) -> str:
        """Finish the file; returns its sha256."""
        self._check_complete()
        self.file.flush()
        self.file.close()
        return self.digest.hexdigest()

    def abort(self) -> None:
        """Close without checking (the caller removes the partial file)."""
        self.file.close()
