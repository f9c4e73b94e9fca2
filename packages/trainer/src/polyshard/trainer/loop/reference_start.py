"""Where the reference of a DPO or GRPO run comes from, so that a resumed run holds the same one.

The reference is the frozen starting model (:mod:`polyshard.trainer.loop.reference`). A run that starts
fresh copies it from the weights it was just built with or loaded, but a resumed run's weights have
trained since: it needs the starting weights back. Every checkpoint of such a run therefore names them
the way a LoRA checkpoint names its base (:class:`~polyshard.trainer.checkpointing.lora_base.BaseRecord`,
in rank 0's ``extra`` under :data:`REFERENCE_KEY`)::

    "reference": {"source": "hf:/abs/sft-hf", "checksum": "<sha256 of the starting weights>"}

``hf:DIR`` (``--init-from hf:DIR``), ``checkpoint:DIR`` (``--init-from DIR``: a checkpoint of another
run, an SFT one say) or ``init:SEED`` (no ``--init-from``). A resumed run opens that source, checks its
checksum (a replaced folder is refused, naming it), loads it into the engine, copies the reference from
it, and only then loads the checkpoint it continues from.

Runs that hold no reference record nothing: LoRA (the reference is the base with its adapters off, and
the base has its own record), ``dpo.reference = "precomputed"`` (its numbers are in the run folder) and
GRPO with ``grpo.beta = 0``.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from polyshard.checkpoint import Checkpoint, CheckpointError
from polyshard.trainer.checkpointing import hugging_face as hf
from polyshard.trainer.checkpointing.lora_base import (
    CHECKPOINT,
    HF,
    INIT,
    BaseRecord,
    InitBase,
    base_checksum,
    open_base,
    recorded_base,
)
from polyshard.trainer.checkpointing.run_reshard import load_into
from polyshard.trainer.config import Config
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.loop.reference import Reference
from polyshard.trainer.tasks import PREFERENCES, ROLLOUTS, task_for

REFERENCE_KEY = "reference"  # the record's key in rank 0's extra


def holds_reference(config: Config) -> bool:
    """Whether the run keeps a frozen copy of its starting model: DPO with ``dpo.reference = "model"``, GRPO
    with ``grpo.beta > 0``, neither with LoRA."""
    if config.lora is not None:
        return False
    task = task_for(config)
    if task is PREFERENCES:
        return config.dpo is None or config.dpo.reference == "model"
    return task is ROLLOUTS and config.grpo is not None and config.grpo.beta > 0


def reference_record(
    config: Config, source: Checkpoint | hf.HFSource | None, resume: bool, out: Path
) -> BaseRecord | None:
    """The record this run's checkpoints carry (None: it holds no reference): the loaded checkpoint's own,
    else the source the run starts from with its checksum (collective: the ranks share the hashing)."""
    if not holds_reference(config):
        return None
    if isinstance(source, Checkpoint):
        recorded = recorded_base(source, REFERENCE_KEY)
        if recorded is not None:
            return recorded
        if resume:
            raise CheckpointError(
                f"{source.folder} names no reference (the starting weights of this DPO or GRPO run; checkpoints "
                "written before polyshard 0.5 do not); start the run again with --overwrite"
            )
        return BaseRecord(f"{CHECKPOINT}{source.folder.resolve()}", base_checksum(source, config))
    if isinstance(source, hf.HFSource):
        return BaseRecord(f"{HF}{source.folder.resolve()}", base_checksum(source, config))
    seed = config.training.seed
    return BaseRecord(f"{INIT}{seed}", base_checksum(InitBase(config, seed, out / "checkpoints"), config))


def rebuilt_reference(engine: Engine, record: BaseRecord, source: Checkpoint | hf.HFSource | None) -> Reference | None:
    """Before ``source`` is loaded: the reference from the weights ``record`` names when ``source`` is a
    checkpoint that records them (a resumed run), the engine left holding those weights; None otherwise
    (the reference is copied from the weights the run starts with, once they are loaded)."""
    if not isinstance(source, Checkpoint) or recorded_base(source, REFERENCE_KEY) is None:
        return None
    config = engine.config
    starting = open_base(record, config, source.folder, needs="continues a run whose reference (its starting weights)")
    found = base_checksum(starting, config)
    if found != record.checksum:
        raise CheckpointError(
            f"{source.folder} continues a run whose reference is {record.source} (checksum {record.checksum[:16]}), "
            f"but that source now has checksum {found[:16]}: it was replaced or changed; put back the weights the "
            "run started from"
        )
    load_into(engine, starting, weights_only=True)
    if dist.get_rank() == 0:
        print(f"reference: the starting weights from {record.source}", flush=True)
    return Reference(engine)
