"""``dpo.reference = "precomputed"``: the reference's log-probs of every pair computed once, before the first
step, and kept in the run folder instead of a frozen copy of the model.

The pass goes over each set (training, then validation) in global batches of the run's own size, in
order, each data rank taking its part as the loader would, so every forward has the shape of a training
step's (the same microbatches, the same cp chunks): the numbers are what the held reference would give
on this layout. The last batch is filled from the set's start, and those repeated pairs are not stored
again. The rank of each data rank that holds the loss (:attr:`PreferenceRun._holder`) fills in its pairs'
log-probs (float32 sums, kept as float64: exactly what a held reference packs) and one all-reduce over
every rank gives each the whole (pairs, 2) array: chosen, rejected.

``<out>/reference_logps.safetensors`` holds the two arrays and, in its metadata, each set's number of
pairs and a sha256 over each pair's digest (blake2b of its token and label rows: the data as the run
cuts it, the context length included), and a sha256 of the arrays themselves. A resumed run reads the
file back after the same pass without the model (digests only): a changed data source, context or a
file edited since is a one-line error, as is a missing one (the starting weights are gone by then).

Memory: 16 bytes per pair on every rank (a million pairs: 16 MB), and no copy of the model.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from polyshard.collectives import ops
from polyshard.data.examples import Examples, Rows
from polyshard.data.loader import ShardedLoader
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.errors import DataError
from polyshard.trainer.loop.step import split_batch

FILE = "reference_logps.safetensors"
FORMAT = "polyshard.reference_logps/1"
SETS = ("train", "val")

Logps = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
"""(inputs, labels) of this data rank's rows -> each row's reference log-prob on the holder's ranks."""


@dataclass(frozen=True)
class StoredLogps:
    """Each set's (pairs, 2) float64 reference log-probs, chosen then rejected."""

    train: torch.Tensor
    val: torch.Tensor


def _parts(loader: ShardedLoader, examples: Examples) -> Iterator[tuple[np.ndarray, np.ndarray, Rows]]:
    """(this data rank's pair numbers, which of them are new, their rows) per global batch, in order."""
    count, size = len(examples), loader.global_batch
    local = size // loader.world_size  # the loader's batches split evenly (make_loaders)
    for start in range(0, count, size):
        positions = np.arange(start, start + size, dtype=np.int64)[loader.rank * local : (loader.rank + 1) * local]
        pairs = positions % count  # the last batch filled from the start: every forward is a whole batch
        yield pairs, positions < count, examples.rows(pairs)


def _digests(rows: Rows) -> np.ndarray:
    """One int64 per pair: blake2b of its (2, width) tokens and labels."""
    tokens, labels = rows["tokens"].astype("<i8"), rows["labels"].astype("<i8")
    return np.array(
        [
            np.frombuffer(hashlib.blake2b(t.tobytes() + y.tobytes(), digest_size=8).digest(), "<i8")[0]
            for t, y in zip(tokens, labels)
        ],  # fmt: skip
        dtype=np.int64,
    )


def _pass(
    engine: Engine, loader: ShardedLoader, holder: bool, logps: Logps | None
) -> tuple[torch.Tensor | None, np.ndarray]:
    """One set's (pairs, 2) log-probs (None without ``logps``) and its per-pair digests, on every rank."""
    examples = loader.sources[0]
    values = torch.zeros(len(examples), 2, dtype=torch.float64, device=engine.device)
    digests = torch.zeros(len(examples), dtype=torch.int64, device=engine.device)
    # without the model only the holders read (their digests); with it every rank runs the forward
    for pairs, new, rows in _parts(loader, examples) if logps is not None or holder else ():
        if logps is not None:
            inputs, labels = (t.to(engine.device) for t in split_batch(engine.config, rows))
            found = logps(inputs, labels)
            if holder and found is not None:
                kept = torch.as_tensor(new, device=engine.device)
                values[torch.as_tensor(pairs[new], device=engine.device)] = found.detach().double().view(-1, 2)[kept]
        if holder:
            where = torch.as_tensor(pairs[new], device=engine.device)
            digests[where] = torch.as_tensor(_digests(rows)[new], device=engine.device)
    # each pair was filled on exactly one rank (its data rank's holder), zeros elsewhere: the sums are exact
    ops.all_reduce(digests)
    if logps is not None:
        ops.all_reduce(values)
    return (values.cpu() if logps is not None else None), digests.cpu().numpy()


def _fingerprint(digests: np.ndarray) -> str:
    return hashlib.sha256(digests.astype("<i8").tobytes()).hexdigest()


def _values_hash(stored: StoredLogps) -> str:
    return hashlib.sha256(stored.train.numpy().tobytes() + stored.val.numpy().tobytes()).hexdigest()


def compute(
    engine: Engine, loaders: tuple[ShardedLoader, ShardedLoader], holder: bool, logps: Logps, out: Path
) -> StoredLogps:
    """Every pair's reference log-probs (collective: every rank calls it), written to ``out``/FILE by rank 0."""
    (train, train_digests), (val, val_digests) = (_pass(engine, loader, holder, logps) for loader in loaders)
    assert train is not None and val is not None
    stored = StoredLogps(train, val)
    if engine.mesh.rank == 0:
        _write(out / FILE, stored, {"train": train_digests, "val": val_digests})
    return stored


def _write(path: Path, stored: StoredLogps, digests: dict[str, np.ndarray]) -> None:
    from safetensors.torch import save_file

    metadata = {"format": FORMAT, "values": _values_hash(stored)}
    for name in SETS:
        metadata.update({f"{name}_pairs": str(len(digests[name])), f"{name}_data": _fingerprint(digests[name])})
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # renamed into place whole
    save_file({"train": stored.train.contiguous(), "val": stored.val.contiguous()}, str(temp), metadata=metadata)
    temp.replace(path)


def load(engine: Engine, loaders: tuple[ShardedLoader, ShardedLoader], holder: bool, out: Path) -> StoredLogps:
    """The log-probs a run's start wrote to ``out``/FILE, checked against the data this run reads
    (collective: the digests pass). One line naming the file and the fix otherwise."""
    path = out / FILE
    again = "start the run again with --overwrite (its first step computes them anew)"
    if not path.is_file():
        raise DataError(
            f"{path} is missing: a run with dpo.reference = 'precomputed' resumes from the reference log-probs "
            f"its start wrote there (the starting weights are gone); {again}"
        )
    stored, metadata = _read(path, again)
    for name, loader in zip(SETS, loaders):
        _, digests = _pass(engine, loader, holder, None)
        recorded = (metadata.get(f"{name}_pairs"), metadata.get(f"{name}_data"))
        if recorded != (str(len(digests)), _fingerprint(digests)):
            raise DataError(
                f"{path} was computed for {recorded[0]} {name} pairs (data sha256 {str(recorded[1])[:12]}), but the "
                f"run reads {len(digests)} (sha256 {_fingerprint(digests)[:12]}): the data, the tokenizer or the "
                f"context length changed since the run started; resume with those it started with, or {again}"
            )
    return stored


def _read(path: Path, again: str) -> tuple[StoredLogps, dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as err:
        raise DataError(f"{path} is not a readable safetensors file ({err}); {again}") from err
    if metadata.get("format") != FORMAT or set(tensors) != set(SETS):
        raise DataError(f"{path} is not a file of reference log-probs this polyshard writes; {again}")
    for name in SETS:
        value = tensors[name]
        if value.dtype != torch.float64 or value.dim() != 2 or value.shape[1] != 2:
            raise DataError(
                f"{path}: {name!r} is {value.dtype} of shape {tuple(value.shape)}, not (pairs, 2) float64; {again}"
            )
    stored = StoredLogps(tensors["train"], tensors["val"])
    if metadata.get("values") != _values_hash(stored):
        raise DataError(f"{path}: its log-probs do not match the checksum it records (the file was changed); {again}")
    return stored, metadata
