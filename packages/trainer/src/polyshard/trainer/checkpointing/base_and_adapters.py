"""A LoRA checkpoint that holds adapters only, read as the whole adapted model: its own tensors, and the
frozen base's from the source it records (:mod:`.lora_base`) once that base's checksum is the recorded one.

Loading into an engine (``--resume``, ``--init-from``, evaluation) reads through :func:`with_base`, a
checkpoint source over both; the unsharded weights (``generate``, ``export --format hf --merge``, the
run's closing sample) come from :func:`base_weights`. A checkpoint that records no base holds its whole
model and is read as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from polyshard.checkpoint import MODEL, Checkpoint, CheckpointError, CheckpointSource, Piece
from polyshard.models import tied_names
from polyshard.trainer.checkpointing.lora_base import (
    HF,
    InitBase,
    base_checksum,
    base_names,
    check_base,
    checksum,
    combined,
    open_base,
    recorded_base,
    tensor_digest,
)
from polyshard.trainer.checkpointing.records import model_dtype
from polyshard.trainer.checkpointing.saved import saved_config
from polyshard.trainer.config import Config


class WithBase:
    """The checkpoint source of an adapters-only checkpoint and its base: a key the checkpoint holds comes
    from it, a base weight from the base, and one the base lacks (prediction depths a Hugging Face folder
    has none of) from the run's own initialisation, which is what the run trained beside (it was frozen)."""

    def __init__(self, adapters: Checkpoint, base: CheckpointSource, config: Config):
        self.adapters, self.base, self.folder = adapters, base, adapters.folder
        self._built = InitBase(config, config.training.seed, adapters.folder)

    def _holder(self, key: str) -> CheckpointSource:
        for source in (self.adapters, self.base, self._built):
            try:
                source.resolve(key)
                return source
            except CheckpointError:
                continue
        raise CheckpointError(
            f"neither {self.folder} nor its base holds a tensor {key!r}; resume it with the [model] it was saved with"
        )

    def resolve(self, key: str) -> str:
        return self._holder(key).resolve(key)

    def global_shape(self, key: str) -> tuple[int, ...]:
        return self._holder(key).global_shape(key)

    def read(self, key: str, start: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._holder(key).read(key, start, shape, dtype)

    def optim_state(self) -> dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        return self.adapters.optim_state()

    def rng_piece(self, coords: Mapping[str, int]) -> Piece | None:
        return self.adapters.rng_piece(coords)

    def read_piece(self, piece: Piece, key: str, local: tuple[slice, ...] = ()) -> torch.Tensor:
        return self.adapters.read_piece(piece, key, local)


def with_base(source: Checkpoint, *, collective: bool) -> CheckpointSource:
    """``source`` with its recorded base behind it, that base's checksum checked (``collective``: rank 0
    computes it for every rank, which all call this); ``source`` itself when it holds its whole model."""
    record = recorded_base(source)
    if record is None:
        return source
    config = saved_config(source)
    base = open_base(record, config, source.folder)
    found = base_checksum(base, config) if collective else checksum(base, base_names(config))
    check_base(record, found, source.folder)
    return WithBase(source, base, config)


def base_weights(source: Checkpoint) -> dict[str, torch.Tensor]:
    """The unsharded base of an adapters-only ``source`` (tied names included), read once and checked against
    the recorded checksum as it is read; empty for a checkpoint that holds its whole model."""
    record = recorded_base(source)
    if record is None:
        return {}
    config = saved_config(source)
    base = open_base(record, config, source.folder)
    both = WithBase(source, base, config)
    digests: dict[str, str | None] = {}
    state, dtype = {}, model_dtype(config)
    for name in base_names(config):
        key = MODEL + name
        shape = tuple(both.global_shape(key))
        whole = both.read(key, (0,) * len(shape), shape, torch.float32)
        # The checksum covers what the base source holds (lora_base.checksum), hashed as it is read.
        digests[name] = tensor_digest(name, [whole], shape) if both._holder(key) is base else None
        state[name] = whole.to(dtype)
    check_base(record, combined(digests), source.folder)
    for alias, name in tied_names(config.model).items():
        if name in state:
            state[alias] = state[name]
    return state


def recorded_folder(source: Checkpoint) -> Path | None:
    """The Hugging Face folder an adapters-only ``source``'s base came from (None: another source or none)."""
    record = recorded_base(source)
    if record is None or not record.source.startswith(HF):
        return None
    return Path(record.source.removeprefix(HF))
