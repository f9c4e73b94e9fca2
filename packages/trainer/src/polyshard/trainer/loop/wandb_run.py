"""Weights & Biases (``logging.wandb``): the run's resolved config once, then every metrics record at its
step, from rank 0 beside ``metrics.jsonl`` (:class:`~polyshard.trainer.loop.metrics.MetricsLog` calls
:meth:`WandbRun.write` with each record it writes). wandb is an optional extra
(``polyshard-trainer[wandb]``, :mod:`polyshard.trainer.extras`), imported only when a run asks for it.

``<run>/wandb_run.json`` holds the W&B run's id and the last step sent to it. A run continued with
``--resume`` (or restarted by torchrun) opens the same W&B run (``resume="allow"``: created if it never
reached the server) and sends only the steps after those. The steps a crashed run logged after its last
checkpoint are the ones the resumed run repeats; W&B would drop each again with a warning (it keeps a
step's first values), so they are not sent: their values agree but for timings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from polyshard.trainer import extras
from polyshard.trainer.config import Config
from polyshard.trainer.errors import ConfigError

STATE_FILE = "wandb_run.json"


class WandbRun:
    """The W&B run of the run folder ``out``: a new one, or with ``resume`` the one ``out`` recorded."""

    def __init__(self, config: Config, out: Path, *, resume: bool):
        wandb = extras.wandb()
        logging = config.logging
        self.state_path = Path(out) / STATE_FILE
        state = _read_state(self.state_path) if resume else {}
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=logging.wandb_project,
                entity=logging.wandb_entity,
                name=logging.wandb_run_name,
                tags=logging.wandb_tags or None,
                mode=logging.wandb_mode,  # None: WANDB_MODE, else online
                dir=None if "WANDB_DIR" in os.environ else str(out),  # its files go to <run>/wandb/ by default
                id=state.get("id"),
                resume="allow" if "id" in state else None,
                config=dataclasses.asdict(config),
            )
        except wandb.errors.Error as err:  # no API key, no connection: the user's to fix
            raise ConfigError(
                f"logging.wandb: W&B did not start the run ({err}); log in with `wandb login` (or set "
                "WANDB_API_KEY), or set logging.wandb_mode = 'offline' and run `wandb sync` later"
            ) from err
        self.id: str = self.run.id
        self.last_step: int = state.get("last_step", 0)
        # A disabled run has an id that names nothing: recording it would make a later run resume it.
        self.recorded = self.run.settings.mode != "disabled"
        self._save_state()

    def write(self, record: dict[str, Any]) -> None:
        """One metrics record at its step, under the names ``metrics.jsonl`` gives it (a list becomes one
        value per entry, ``peak_memory_bytes_per_rank/rank1``, as in TensorBoard)."""
        step = record["step"]
        if step <= self.last_step:  # sent by the run this one resumes (see the module's docstring)
            return
        self.run.log(wandb_values(record), step=step)
        self.last_step = step
        self._save_state()

    def close(self) -> None:
        self.run.finish()

    def _save_state(self) -> None:
        if not self.recorded:
            return
        tmp = self.state_path.with_name(f".{self.state_path.name}.tmp")
        tmp.write_text(json.dumps({"id": self.id, "last_step": self.last_step}) + "\n")
        tmp.replace(self.state_path)  # whole or not at all: a crash here keeps the previous state


def wandb_values(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record as W&B values: every field but ``step`` (given apart), each list split into
    ``key/rank{i}`` entries, which W&B can chart (it cannot chart a list)."""
    values: dict[str, Any] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, list):
            values.update({f"{key}/rank{i}": item for i, item in enumerate(value)})
        else:
            values[key] = value
    return values


def _read_state(path: Path) -> dict[str, Any]:
    """What ``path`` recorded ({} when absent: the run had no W&B run, so a new one starts)."""
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is not readable JSON ({err}); delete it to start a new W&B run") from err
    if not (isinstance(state, dict) and isinstance(state.get("id"), str) and isinstance(state.get("last_step"), int)):
        raise ConfigError(f"{path} holds no W&B run id and last step; delete it to start a new W&B run")
    return state
