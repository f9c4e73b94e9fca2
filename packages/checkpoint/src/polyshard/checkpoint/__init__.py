"""polyshard's sharded checkpoints, usable without the trainer.

- :mod:`.format` — folder and file names, tensor keys, dtype names, the index and its checks.
- :mod:`.source` — :class:`CheckpointSource` (what any reader asks of a checkpoint) and
  :class:`Checkpoint` (a polyshard checkpoint, verified).
- :mod:`.save` — collective save (temporary folder, renamed when complete), open the newest valid one.
- :mod:`.reshard` — write a checkpoint for another mesh from per-rank plans, block by block.
- :mod:`.export` — describe, gather the weights, export one plain safetensors file (streamed).
- :mod:`.hf` — Hugging Face folders: read one as a source, write one tensor at a time.
- :mod:`.writer` — a safetensors file written block by block, hashed as it goes.
"""

from polyshard.checkpoint.export import consolidate, describe, export
from polyshard.checkpoint.format import (
    FORMAT_VERSION,
    MASTER,
    MODEL,
    OPTIM,
    RNG,
    TOKENIZER,
    CheckpointError,
    model_key,
    optim_key,
    read_index,
    step_dir,
    verify_files,
)
from polyshard.checkpoint.hf import HFWeights, TensorLocation, write_hf_folder
from polyshard.checkpoint.reshard import Planned, ReshardReport, plans_from_records, write_resharded
from polyshard.checkpoint.save import (
    LocalTensor,
    complete_checkpoints,
    find_checkpoint,
    latest_checkpoint,
    load_rank,
    open_checkpoint,
    save_checkpoint,
)
from polyshard.checkpoint.source import Checkpoint, CheckpointSource, Piece

__all__ = [
    "FORMAT_VERSION",
    "MASTER",
    "MODEL",
    "OPTIM",
    "RNG",
    "TOKENIZER",
    "Checkpoint",
    "CheckpointError",
    "CheckpointSource",
    "HFWeights",
    "LocalTensor",
    "Piece",
    "Planned",
    "ReshardReport",
    "TensorLocation",
    "complete_checkpoints",
    "consolidate",
    "describe",
    "export",
    "find_checkpoint",
    "latest_checkpoint",
    "load_rank",
    "model_key",
    "open_checkpoint",
    "optim_key",
    "plans_from_records",
    "read_index",
    "save_checkpoint",
    "step_dir",
    "verify_files",
    "write_hf_folder",
    "write_resharded",
]
