"""What an offline W&B run wrote, read back from its ``run-<id>.wandb`` file.

wandb 0.31 writes no ``wandb-summary.json`` or ``config.yaml`` for an offline run and has no Python
reader of its own any more (``wandb.sdk.internal.datastore`` is gone), so the file is read here: a
LevelDB-style log (a 7-byte ``:W&B`` header, then 32 KiB blocks of records, each with a 7-byte header:
CRC32, length, kind FULL/FIRST/MIDDLE/LAST) whose payloads are ``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7  # the file's (":W&B", magic, version) and each record's (crc32, length, kind)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    id: str
    project: str
    name: str
    tags: list[str]
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    """Each logged row: its values by key, with W&B's own ``_step`` (our step), ``_runtime``, ``_timestamp``."""


def _payloads(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", data[:HEADER]
    out, pos, parts = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # too small for a record header: padding up to the next block
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        body = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FIRST, MIDDLE, LAST):
            parts += body
        if kind in (FULL, LAST):
            out.append(body if kind == FULL else parts)
            parts = b""
    return out


def read_offline_run(path: Path) -> OfflineRun:
    """The run, its config (the last value of each key) and its history rows, from ``run-<id>.wandb``."""
    from wandb.proto import wandb_internal_pb2 as pb

    run: OfflineRun | None = None
    for payload in _payloads(Path(path).read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run = OfflineRun(r.run_id, r.project, r.display_name, list(r.tags))
            run.config.update({item.key: json.loads(item.value_json) for item in r.config.update})
        elif kind == "config" and run is not None:
            run.config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history" and run is not None:
            run.history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
    assert run is not None, f"{path} holds no run record"
    return run


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def offline_runs(wandb_dir: Path) -> list[OfflineRun]:
    """Every offline run under ``wandb_dir`` (what WANDB_DIR named), oldest first."""
    files = sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    return [read_offline_run(path) for path in files]
