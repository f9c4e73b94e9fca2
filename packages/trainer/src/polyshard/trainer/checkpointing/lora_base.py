"""The frozen base of a LoRA run, as its checkpoints name it instead of holding it.

A LoRA run trains a few MB of adapters beside a base of many GB that never changes, so its checkpoints
hold what training changes (adapters, their optimizer state, buffers, RNG, data position) and a
:class:`BaseRecord` of the base, in rank 0's ``extra`` (which offline resharding carries over)::

    "lora_base": {"source": "hf:/abs/llama-hf", "checksum": "<sha256, hex>"}

``source`` says where the base is rebuilt from: ``hf:DIR`` (a Hugging Face folder, ``--init-from
hf:DIR``), ``checkpoint:DIR`` (a polyshard checkpoint that holds the whole model, ``--init-from DIR``)
or ``init:SEED`` (no ``--init-from``: the weights the checkpoint's own ``[model]`` builds from
``training.seed`` = SEED, layer by layer as every layout builds them). ``checksum`` is :func:`combined`
of each frozen weight's sha256 (its name, shape and values as float32 whatever dtype they are stored in),
so the same weights give the same checksum from a bf16 folder or an fp32 checkpoint, on any layout, and
the ranks of a run can each hash a share of them. Whoever reads the base back (resume, ``--init-from``,
evaluation, merge, generate) computes it again and refuses another base.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from polyshard.checkpoint import MODEL, Checkpoint, CheckpointError, CheckpointSource, Piece, read_index
from polyshard.models import build_model, layer_of
from polyshard.trainer.checkpointing import hugging_face as hf
from polyshard.trainer.config import Config

BASE_KEY = "lora_base"  # the record's key in rank 0's extra
HF, CHECKPOINT, INIT = "hf:", "checkpoint:", "init:"
BLOCK_BYTES = 64 << 20  # most of one tensor the checksum holds at once


@dataclass(frozen=True)
class BaseRecord:
    source: str
    """``hf:DIR``, ``checkpoint:DIR`` (absolute folders) or ``init:SEED``."""
    checksum: str
    """:func:`checksum` of the base's weights (sha256, 64 hex digits)."""

    def to_json(self) -> dict[str, str]:
        return {"source": self.source, "checksum": self.checksum}


def recorded_base(source: Checkpoint, key: str = BASE_KEY) -> BaseRecord | None:
    """The base ``source`` records under ``key`` (None: it holds its whole model), checked: the index is
    untrusted. ``key``: :data:`BASE_KEY`, or another record of the same form (a DPO or GRPO run's
    reference, :mod:`polyshard.trainer.loop.reference_start`)."""
    raw = source.extra().get(key)
    if raw is None:
        return None
    where = f"{source.folder}/index.json"
    if not isinstance(raw, dict) or not isinstance(raw.get("source"), str) or not isinstance(raw.get("checksum"), str):
        raise CheckpointError(f"{where}: {key} is {raw!r}, not a base's source and checksum; the index is damaged")
    record = BaseRecord(raw["source"], raw["checksum"])
    seed = record.source.removeprefix(INIT)
    kind_ok = record.source.startswith((HF, CHECKPOINT)) or (record.source.startswith(INIT) and seed.isdigit())
    if not kind_ok or len(record.checksum) != 64:
        raise CheckpointError(f"{where}: {key} {raw!r} names no base polyshard records; the index is damaged")
    return record


def recorded_folder_settings(folder: Path) -> dict[str, object] | None:
    """The model settings of the Hugging Face folder the checkpoint ``folder`` names as its LoRA base (None:
    it names none), read from its index alone: a resumed run takes them as ``--init-from hf:DIR`` did."""
    ranks = read_index(folder).get("ranks") or [{}]
    raw = ranks[0].get("extra", {}).get(BASE_KEY) if isinstance(ranks[0], dict) else None
    source = raw.get("source") if isinstance(raw, dict) else None
    if not isinstance(source, str) or not source.startswith(HF):
        return None
    try:
        return hf.model_settings(Path(source.removeprefix(HF)))
    except (CheckpointError, OSError) as err:
        raise CheckpointError(
            f"{folder} holds LoRA adapters only; their base {source} cannot be read ({err}); put the base back "
            "where it was trained from"
        ) from err


def base_names(config: Config) -> list[str]:
    """The frozen base's parameters by global name, sorted (the model on the meta device: no adapters)."""
    return sorted(name for name, _ in build_model(config.model, layers=()).named_parameters())


class InitBase:
    """The base a run builds without ``--init-from`` (its ``[model]`` from ``seed``), as a read-only
    checkpoint source: a layer is built when one of its tensors is asked for (the last one kept), seeded by
    its index as :func:`polyshard.models.build_model` seeds it on every layout. ``folder``: for messages."""

    def __init__(self, config: Config, seed: int, folder: Path):
        self.folder, self.config, self.seed = folder, config, seed
        skeleton = build_model(config.model, layers=())
        self.shapes = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
        self._layer: tuple[int, dict[str, torch.Tensor]] | None = None

    def resolve(self, key: str) -> str:
        if not key.startswith(MODEL) or key[len(MODEL) :] not in self.shapes:
            raise CheckpointError(f"the base built from {self.folder}'s settings has no tensor {key!r}")
        return key

    def global_shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[self.resolve(key)[len(MODEL) :]]

    def read(self, key: str, start: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        name = self.resolve(key)[len(MODEL) :]
        layer = layer_of(name)
        if self._layer is None or self._layer[0] != layer:
            model = build_model(self.config.model, seed=self.seed, layers=(layer,))
            self._layer = (layer, {n: p.detach() for n, p in model.named_parameters() if layer_of(n) == layer})
        whole = self._layer[1][name]
        out = torch.zeros(shape, dtype=dtype)  # zero past the global shape, as every source pads
        region = tuple(slice(s, min(s + n, g)) for s, n, g in zip(start, shape, whole.shape))
        out[tuple(slice(0, r.stop - r.start) for r in region)] = whole[region].to(dtype)
        return out

    def optim_state(self) -> dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        return {}

    def rng_piece(self, coords: Mapping[str, int]) -> Piece | None:
        return None

    def read_piece(self, piece: Piece, key: str, local: tuple[slice, ...] = ()) -> torch.Tensor:
        raise CheckpointError(f"the base built from {self.folder}'s settings has no saved pieces")


def open_base(
    record: BaseRecord, config: Config, where: Path, needs: str = "holds LoRA adapters only; their base"
) -> CheckpointSource:
    """The base ``record`` names, opened for the model of ``config`` (the run that saved ``where``); a base
    that is gone or is not that model is one line naming both (``needs``: what ``where`` wants of it)."""
    try:
        if record.source.startswith(INIT):
            return InitBase(config, int(record.source.removeprefix(INIT)), where)
        if record.source.startswith(HF):
            return hf.HFSource(Path(record.source.removeprefix(HF)), config)
        return Checkpoint(Path(record.source.removeprefix(CHECKPOINT)))
    except (CheckpointError, OSError) as err:
        raise CheckpointError(
            f"{where} {needs} {record.source} cannot be read ({err}); put the base back where it was trained from"
        ) from err


def tensor_digest(name: str, blocks: Iterable[torch.Tensor], shape: tuple[int, ...]) -> str:
    """sha256 of one base weight: its name and shape, then its values as float32 (row blocks in order)."""
    digest = hashlib.sha256(f"{name} {list(shape)}\n".encode())
    for block in blocks:
        digest.update(block.to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _read_digest(source: CheckpointSource, name: str) -> str | None:
    """:func:`tensor_digest` of ``name`` in ``source``, read in row blocks of at most :data:`BLOCK_BYTES`;
    None for a weight the source lacks (prediction depths a Hugging Face folder has none of: every run
    from that source starts them alike)."""
    key = MODEL + name
    try:
        source.resolve(key)
    except CheckpointError:
        return None
    shape = tuple(source.global_shape(key))
    if not shape:
        return tensor_digest(name, [source.read(key, (), (), torch.float32)], shape)
    rows = max(1, BLOCK_BYTES // max(1, 4 * math.prod(shape[1:])))
    starts = range(0, shape[0], rows)
    blocks = (
        source.read(key, (i, *(0,) * (len(shape) - 1)), (min(rows, shape[0] - i), *shape[1:]), torch.float32)
        for i in starts
    )
    return tensor_digest(name, blocks, shape)


def combined(digests: Mapping[str, str | None]) -> str:
    """The base's checksum from its weights' :func:`tensor_digest` (sha256 of "name digest" lines in name
    order, the weights a source lacks left out), so ranks can each hash a share of the weights."""
    lines = "".join(f"{name} {digest}\n" for name, digest in sorted(digests.items()) if digest is not None)
    return hashlib.sha256(lines.encode()).hexdigest()


def checksum(source: CheckpointSource, names: list[str]) -> str:
    """The checksum of the weights ``names`` in ``source``, on this process alone."""
    return combined({name: _read_digest(source, name) for name in names})


def base_checksum(source: CheckpointSource, config: Config) -> str:
    """:func:`checksum` of ``config``'s base in ``source``, each rank hashing a contiguous share of the weights
    in name order (an initialised base builds only the layers of its share) and every rank getting the whole:
    collective when a process group is up, so every rank calls it."""
    names = base_names(config)
    if not dist.is_initialized():
        return checksum(source, names)
    rank, world = dist.get_rank(), dist.get_world_size()
    share = -(-len(names) // world)
    mine = {name: _read_digest(source, name) for name in names[rank * share : (rank + 1) * share]}
    every: list[dict[str, str | None] | None] = [None] * world
    dist.all_gather_object(every, mine)
    return combined({name: digest for part in every if part for name, digest in part.items()})


def check_base(record: BaseRecord, found: str, where: Path) -> None:
    """Refuse a base whose checksum is not the recorded one, naming both."""
    if found != record.checksum:
        raise CheckpointError(
            f"{where} holds LoRA adapters trained on the base {record.source} (checksum {record.checksum[:16]}), but "
            f"that base now has checksum {found[:16]}: it was replaced or changed; put back the base the adapters "
            "were trained on"
        )
