"""Where a run starts: a fresh engine, a checkpoint saved on any mesh (``--resume``,
``--init-from``), a Hugging Face folder (``--init-from hf:DIR``), or, after torchrun restarted the
worker group, the newest checkpoint this same job wrote."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from polyshard.checkpoint import Checkpoint, CheckpointError, latest_checkpoint, open_checkpoint
from polyshard.checkpoint.format import INDEX_LIMIT
from polyshard.checkpoint.hf_cache import hf_folder
from polyshard.checkpoint.untrusted import read_json
from polyshard.data.loader import ShardedLoader
from polyshard.trainer.checkpointing import hugging_face as hf
from polyshard.trainer.checkpointing.lora_base import (
    CHECKPOINT,
    HF,
    INIT,
    BaseRecord,
    InitBase,
    base_checksum,
    recorded_base,
)
from polyshard.trainer.checkpointing.run_export import saved_config
from polyshard.trainer.checkpointing.run_reshard import load_into
from polyshard.trainer.config import Config
from polyshard.trainer.engine.engine import Engine


def continue_from(
    engine: Engine, config: Config, source: Checkpoint, train_data: ShardedLoader, log: bool
) -> tuple[int, list[float]]:
    """Continue from the checkpoint ``source``, saved on this mesh or any other: the engine's state and
    the data position are restored; returns its step and the losses it recorded."""
    folder = source.folder
    load_into(engine, source)
    extra = source.extra()
    train_data.load_state_dict(extra["data"])
    losses = [float(loss) for loss in extra["losses"]]
    saved_batch = saved_config(source).training.global_batch_size
    if log and dist.get_rank() == 0:
        last = f", last loss {losses[-1]:.4f}" if losses else ""
        origin = source.index.get("resharded_from", {}).get("mesh")
        mesh = f"mesh {source.index['mesh']}" + (f" (resharded from {origin})" if origin else "")
        print(f"continuing from {folder}: step {source.step}, {mesh}{last}", flush=True)
    if dist.get_rank() == 0 and saved_batch != config.training.global_batch_size:
        print(
            f"note: {folder} was trained with global_batch_size={saved_batch}; the data position "
            f"(epoch {extra['data']['epoch']}, example {extra['data']['position']}) carries over, later batches "
            f"hold {config.training.global_batch_size} examples",
            flush=True,
        )
    return source.step, losses


def checkpoint_to_load(
    config: Config, out: Path, resume: bool, init_from: str | Path | None
) -> Checkpoint | hf.HFSource | None:
    """The checkpoint a run starts from, opened and verified: ``init_from`` (a step folder or a folder
    of them, or ``hf:DIR``, a Hugging Face model folder: weights only, from step 0), or with
    ``resume`` the newest valid one under ``out/checkpoints`` (newer ones that fail verification
    are named and passed over); None for a fresh start."""

    def skipped(folder: Path, err: Exception) -> None:
        if dist.get_rank() == 0:
            print(f"skipping {folder}: {err}", flush=True)

    folder = hf_folder(init_from)  # hf:DIR, or hf:org/name from the local Hugging Face cache
    if folder is not None:
        return hf.HFSource(folder, config)
    if init_from is not None:
        return open_checkpoint(init_from, skipped)
    if resume:
        if latest_checkpoint(out / "checkpoints") is None:
            raise CheckpointError(f"--resume: no complete checkpoint under {out / 'checkpoints'}")
        return open_checkpoint(out / "checkpoints", skipped)
    return None


def lora_base_of(config: Config, source: Checkpoint | hf.HFSource | None, resume: bool, out: Path) -> BaseRecord | None:
    """The base a LoRA run's checkpoints name instead of holding it (:mod:`polyshard.trainer.checkpointing.lora_base`),
    once ``source`` is loaded: the one the loaded checkpoint records (checked as it was loaded), else where
    the run took its base from, with its checksum (collective: rank 0 computes it). None: the checkpoints hold
    the whole model (no ``[lora]``, or a run resumed from a checkpoint that holds it, as all did before)."""
    if config.lora is None:
        return None
    if isinstance(source, Checkpoint):
        recorded = recorded_base(source)
        if recorded is not None or resume:
            return recorded
        base: Checkpoint | hf.HFSource | InitBase = source
        origin = f"{CHECKPOINT}{source.folder.resolve()}"
    elif isinstance(source, hf.HFSource):
        base, origin = source, f"{HF}{source.folder.resolve()}"
    else:
        seed = config.training.seed
        base, origin = InitBase(config, seed, out / "checkpoints"), f"{INIT}{seed}"
    return BaseRecord(origin, base_checksum(base, config))


def job_id() -> str | None:
    """The torchrun job this process belongs to (its rendezvous id; every restart of the job keeps it)."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def saved_by_this_job(out: Path) -> bool:
    """Whether the newest complete checkpoint under ``out`` was written by this torchrun job: a
    restarted worker group (after a crash, or an elastic change of nodes) continues from it."""
    latest = latest_checkpoint(out / "checkpoints")
    if latest is None or job_id() is None:
        return False
    try:
        ranks = read_json(latest, latest / "index.json", limit=INDEX_LIMIT).get("ranks", [])
        return bool(ranks) and ranks[0].get("extra", {}).get("job") == job_id()
    except (OSError, ValueError, AttributeError, TypeError, CheckpointError):
        return False  # an unreadable index: the normal resume path reports it
