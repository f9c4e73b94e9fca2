"""Before any process starts: the config parsed, validated and resolved once, written for the workers.

``polyshard train`` reads the TOML file and its ``--set`` overrides once (:func:`read_settings`),
then :func:`prepare_launch` checks everything a user can get wrong before a process starts (every
field, the constraints between them, each node count an elastic job may take, the run folder,
``--resume`` and ``--init-from``, the data source, a Hugging Face folder's settings). The workers
do not parse the file or the overrides again: :meth:`Launch.write` puts the resolved settings into
the run folder (:data:`RESOLVED_CONFIG`), and each worker reads that (:func:`read_resolved`).
``parallel.dp = "auto"`` stays symbolic there, so a restart on another number of nodes resolves it
again from the processes present.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyshard.checkpoint import CheckpointError, find_checkpoint, hf_cache, latest_checkpoint, read_index
from polyshard.models.settings import with_folder_settings
from polyshard.trainer.checkpointing.hugging_face import PREFIX, HFSource, model_settings
from polyshard.trainer.checkpointing.lora_base import recorded_folder_settings
from polyshard.trainer.config import Config, apply_overrides, from_dict, read_toml
from polyshard.trainer.config.legacy import moved
from polyshard.trainer.engine.constraints import layout_notes, validate
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop import faults
from polyshard.trainer.loop.plan_check import PLAN_FILE, PlannedStep
from polyshard.trainer.tasks import task_for

RESOLVED_CONFIG = "config.json"  # in the run folder: the settings every worker (and every restart) reads
USER_ERROR_MARK = ".user-error"  # made by the first worker that reports a user's mistake (runtime.worker)


def read_settings(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The TOML file ``path`` with ``overrides`` (``section.key=value``) applied: raw settings, not yet checked."""
    return apply_overrides(read_toml(path), overrides)


@dataclass(frozen=True)
class Launch:
    """A run that passed every check: what the launcher starts and what its workers read."""

    settings: dict[str, Any]
    """The resolved settings (``parallel.dp`` may stay ``"auto"``)."""
    config: Config
    """The settings parsed for the first node count."""
    out: Path
    nproc: int
    """Processes per node."""
    nodes: tuple[int, int]
    """torchrun's --nnodes: (N, N), or (MIN, MAX) for an elastic job."""
    resume: bool = False
    init_from: str | None = None
    """A checkpoint folder, or ``hf:DIR`` (a model id from the cache resolved to its folder); absolute."""
    notes: list[str] = field(default_factory=list)
    """What the layout does that the user may not expect."""
    prediction: PlannedStep | None = None
    """The planner's, when it chose the layout (``--layout auto``)."""

    def write(self) -> Path:
        """Write the resolved settings (and the prediction, :data:`PLAN_FILE`) into the run folder,
        each whole or not at all; returns the config file."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / USER_ERROR_MARK).unlink(missing_ok=True)  # this run's first user error is reported anew
        path = self.out / RESOLVED_CONFIG
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.settings, indent=1) + "\n")
        tmp.replace(path)
        if self.prediction is not None:
            self.prediction.write(self.out / PLAN_FILE)
        return path

    def worker_args(self) -> list[str]:
        """The worker's command line (:mod:`polyshard.trainer.runtime.worker`)."""
        args = ["--out", str(self.out.resolve())]
        if self.resume:
            args.append("--resume")
        if self.init_from is not None:
            args += ["--init-from", self.init_from]
        if self.prediction is not None:
            args += ["--plan", str((self.out / PLAN_FILE).resolve())]
        return args


def prepare_launch(
    settings: Mapping[str, Any],
    *,
    out: Path,
    nproc: int | None = None,
    nodes: tuple[int, int] = (1, 1),
    resume: bool = False,
    init_from: str | None = None,
    prediction: PlannedStep | None = None,
    overwrite: bool = False,
) -> Launch:
    """Check a run before any process starts; a user's mistake is a :class:`ConfigError`,
    :class:`CheckpointError` or :class:`DataError` naming the field, file or flag (or a ValueError
    for ``POLYSHARD_FAULT``). A new run (no ``resume``) into a folder that holds another run's
    checkpoints is refused unless ``overwrite``: its saves would replace theirs step by step."""
    resolved: dict[str, Any] = copy.deepcopy(dict(settings))  # the caller's tables stay as they are
    settings = resolved
    low, high = nodes
    if resume and init_from is not None:
        raise ConfigError("give --resume (continue this run) or --init-from CKPT (start from another), not both")
    hf_folder = hf_cache.hf_folder(init_from)  # hf:DIR, or hf:org/name from the local Hugging Face cache
    if init_from is not None and hf_folder is None:
        read = find_checkpoint(init_from)  # a missing checkpoint is reported before any process starts
        if read.resolve().is_relative_to((out / "checkpoints").resolve()):  # its saves would replace or prune it
            raise CheckpointError(
                f"--init-from {read} lies in {out / 'checkpoints'}, where this run saves; give another --out "
                "(or --resume, without --init-from, to continue that run)"
            )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give the folder the run writes into")
    latest = latest_checkpoint(out / "checkpoints")
    if latest is not None and not (resume or overwrite):
        raise CheckpointError(
            f"--out {out} holds a run's checkpoints (the latest {latest.name}); give --resume to continue it, "
            "another --out, or --overwrite to start a new run there (its checkpoints are replaced as it saves)"
        )
    latest = latest if resume else None
    if resume and latest is None:
        raise CheckpointError(f"--resume: no complete checkpoint under {out / 'checkpoints'}; drop --resume to start")
    if hf_folder is not None and isinstance(settings.get("model", {}), Mapping):
        # The model's settings the [model] table leaves unset come from the folder's config.json; what it
        # sets stays, and HFSource below names any that disagree with the folder (both values and the fix).
        settings["model"] = with_folder_settings(settings.get("model", {}), model_settings(hf_folder))
    base_settings = recorded_folder_settings(latest) if latest is not None else None  # a LoRA run from hf:DIR
    if base_settings is not None and isinstance(settings.get("model", {}), Mapping):
        settings["model"] = with_folder_settings(settings.get("model", {}), base_settings)
    # Every size an elastic job may take must be a valid mesh, each read once. An old spelling is read with
    # one note.
    spellings: list[str] = []
    sizes: dict[int, Config] = {}
    if nproc is None:  # the config's mesh size (dp='auto' asks for --nproc here)
        fixed = from_dict(settings, note=spellings.append)
        nproc = fixed.parallel.world_size // low
        if fixed.parallel.world_size == nproc * low:
            sizes[low] = fixed
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give at least one process per node")
    for count in range(low, high + 1):
        if count not in sizes:
            sizes[count] = from_dict(settings, world_size=nproc * count, note=spellings.append)
    for line in dict.fromkeys(spellings):
        print(line, file=sys.stderr)
    if spellings:  # the run folder and its workers hold the new spelling
        resolved.update(moved(resolved, None))
        resolved["model"] = dataclasses.asdict(sizes[low].model)
    if low != high and sizes[low].parallel.dp == sizes[high].parallel.dp:
        raise ConfigError(f"--nnodes={low}:{high} (elastic) needs parallel.dp='auto', so dp follows the nodes")
    for count, parsed in sizes.items():
        validate(parsed, world_size=nproc * count)
    config = sizes[low]
    if hf_folder is not None:
        # config.json against the settings, then every weight file's header: names, shapes, dtypes.
        HFSource(hf_folder, config)
    if latest is not None:
        _check_same_optimizer(config, latest)
    task_for(config).check_data(config)
    faults.parse(os.environ.get("POLYSHARD_FAULT", ""))
    if hf_folder is not None:
        init_from = f"{PREFIX}{hf_folder.resolve()}"
    elif init_from is not None:
        init_from = str(Path(init_from).resolve())
    return Launch(dict(settings), config, out, nproc, nodes, resume, init_from, layout_notes(config), prediction)


def _check_same_optimizer(config: Config, folder: Path) -> None:
    """A resumed run continues the optimizer state it saved: AdamW's moments are no Muon momentum.
    Read from the index alone (the files are verified when the workers open them)."""
    settings = read_index(folder).get("config")
    settings = moved(settings, None) if isinstance(settings, dict) else {}  # a checkpoint 0.4 wrote: training.optimizer
    chosen = settings.get("optimizer")
    saved = chosen.get("name", "adamw") if isinstance(chosen, dict) else "adamw"
    if saved != config.optimizer.name:
        raise CheckpointError(
            f"--resume: {folder} holds the optimizer state of optimizer.name={saved!r}, but this run "
            f"sets {config.optimizer.name!r}; resume with --set optimizer.name={saved}"
        )


def read_resolved(path: str | Path, world_size: int | None = None) -> Config:
    """A worker's config: the settings :meth:`Launch.write` wrote, with ``parallel.dp = "auto"``
    resolved for ``world_size`` processes."""
    path = Path(path)
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{path}: the run's resolved config is unreadable ({err}); launch with `polyshard train`"
        ) from err
    if not isinstance(settings, dict):
        raise ConfigError(f"{path}: the run's resolved config is not a table; launch with `polyshard train`")
    return from_dict(settings, world_size, saved=True)  # a run folder 0.2 wrote too
