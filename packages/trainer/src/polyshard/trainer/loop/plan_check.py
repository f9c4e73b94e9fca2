"""The plan check: a run the planner laid out holds the planner's predictions against what it measures.

The launcher (``polyshard train --layout auto``) writes the prediction for the chosen layout into
the run folder (:data:`PLAN_FILE`, a :class:`PlannedStep`) and names it to the workers; the trainer
needs nothing of the planner to compare (:class:`PlanCheck`).

:class:`SavedTensorMeter` counts the bytes autograd saves for backward while a step runs, through
``torch.autograd.graph.saved_tensors_hooks``: each saved tensor's storage is counted once while
any saved reference to it lives (views share a storage), parameters are left out (they are model
states, not activations), and the peak is kept. It measures activations the same way on CPU and
GPU, which the process's peak memory (max RSS on CPU) cannot: RSS also holds the interpreter,
libraries and every allocator cache. It does not see inside activation-checkpointed blocks, whose
own hooks take over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyshard.collectives import ops
from polyshard.dp import bytes_held
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.loop.hooks import Hook

PLAN_FILE = "plan.json"  # in the run folder: the planner's prediction for the layout it chose


class _Saved:
    """One saved reference; when autograd drops it, its storage's count goes down."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedTensorMeter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """``with SavedTensorMeter(params) as meter: step()`` then ``meter.peak`` (bytes)."""

    def __init__(self, parameters: Iterable[nn.Parameter] = ()):
        self._params = {p.untyped_storage().data_ptr() for p in parameters}
        self._live: dict[int, list[int]] = {}  # storage -> [bytes, saved references]
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if isinstance(tensor, nn.Parameter) or key in self._params or storage.nbytes() == 0:
            return tensor
        entry = self._live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def model_state_bytes_held(engine: Any) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes this rank's engine holds now (call at the optimizer step)."""
    totals = [0, 0, 0]
    for (_, wrapper), optimizer in zip(sorted(engine.wrappers.items()), engine.optimizers):
        report = bytes_held(wrapper, optimizer)
        for i, value in enumerate((report.params, report.grads, report.optimizer_state)):
            totals[i] += value
    return totals[0], totals[1], totals[2]


@dataclass(frozen=True)
class PlannedStep:
    """What the planner predicts for a layout: the step time, and per pipeline rank the model-state
    bytes and the peak bytes saved for backward."""

    step_s: float
    states_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]

    def write(self, path: Path) -> None:
        """The prediction as JSON, whole or not at all."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def read(cls, path: str | Path) -> PlannedStep:
        """A prediction file (untrusted: each value is checked; a bad one is a ConfigError naming it)."""
        try:
            raw = json.loads(Path(path).read_text())
            step_s, states, activations = raw["step_s"], raw["states_bytes"], raw["activation_bytes"]
            numbers = [step_s, *states, *activations]
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in numbers):
                raise ValueError("every value must be a finite number")
            if step_s <= 0 or not states or len(states) != len(activations):
                raise ValueError("step_s must be > 0 and both byte lists as long as the pipeline")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(
                f"{path}: not a plan prediction ({err}); run `polyshard train --layout auto` again"
            ) from err
        return cls(float(step_s), tuple(map(float, states)), tuple(map(float, activations)))


class PlanCheck(Hook):
    """After the first steps of a run the planner laid out (given a :class:`PlannedStep`): the
    predicted step time against the median of steps 2 and 3 (step 1 warms up), and on step 4 the
    planner's memory per rank against the model-state bytes the engine holds at the optimizer step
    and the peak of bytes saved for backward (:class:`SavedTensorMeter`, whose hooks slow that step,
    so it is not timed). The rank the planner expects to be heaviest is reported."""

    def __init__(self, prediction: PlannedStep | None, engine: Any, start: int, verbose: bool = False):
        self.prediction, self.engine, self.verbose = prediction, engine, verbose
        self.enabled = prediction is not None
        self.timed, self.checked = (start + 2, start + 3), start + 4  # steps counted from 1
        self.seconds: list[float] = []
        self.meter: SavedTensorMeter | None = None
        self.held: tuple[int, int, int] | None = None

    def around_update(self, step: int) -> contextlib.AbstractContextManager[Any]:
        if not (self.enabled and step == self.checked):
            return contextlib.nullcontext()
        params = [p for stage in self.engine.stages.values() for p in stage.parameters()]
        self.meter = SavedTensorMeter(params)
        return self.meter

    def before_zero_grad(self, step: int) -> None:
        if self.enabled and step == self.checked:
            self.held = model_state_bytes_held(self.engine)

    def after_step(self, step: int, seconds: float, record: dict[str, Any]) -> None:
        """At the checked step, the check's figures join the record (every rank must call it: it
        gathers over ranks), and rank 0 prints them when verbose."""
        checked = self.check(step, seconds)
        if checked is not None:
            record.update(checked)
            if self.verbose:
                print(plan_check_line(checked), flush=True)

    def check(self, step: int, seconds: float) -> dict[str, float] | None:
        """The check's figures at the checked step; None before (and after)."""
        if self.prediction is None:
            return None
        if step in self.timed:
            self.seconds.append(seconds)
        if step != self.checked or self.held is None or self.meter is None:
            return None
        stage = self.engine.mesh.coord("pp")
        if len(self.prediction.states_bytes) != self.engine.mesh.size("pp"):
            raise ConfigError(
                f"the plan prediction covers {len(self.prediction.states_bytes)} pipeline ranks, this run has "
                f"{self.engine.mesh.size('pp')}; it was made for another layout"
            )
        predicted = self.prediction.states_bytes[stage], self.prediction.activation_bytes[stage]
        mine = torch.tensor(
            [predicted[0], float(sum(self.held)), predicted[1], float(self.meter.peak)], dtype=torch.float64
        )
        everyone = ops.all_gather(mine.to(self.engine.device), 0).view(-1, 4).cpu()
        heaviest = everyone[int((everyone[:, 0] + everyone[:, 2]).argmax())].tolist()
        return {
            "plan_step_s_predicted": self.prediction.step_s,
            "plan_step_s_measured": statistics.median(self.seconds) if self.seconds else seconds,
            "plan_states_bytes_predicted": heaviest[0],
            "plan_states_bytes_held": heaviest[1],
            "plan_activation_bytes_predicted": heaviest[2],
            "plan_activation_bytes_saved": heaviest[3],
        }


def plan_check_line(record: dict[str, float]) -> str:
    """One line: predicted against measured step time and memory."""
    predicted, measured = record["plan_step_s_predicted"], record["plan_step_s_measured"]
    mb = 1e6
    return (
        f"plan check: step {predicted:.4g} s predicted, {measured:.4g} s measured ({measured / predicted - 1:+.0%}); "
        f"heaviest rank: model states {record['plan_states_bytes_predicted'] / mb:.4g} MB predicted, "
        f"{record['plan_states_bytes_held'] / mb:.4g} MB held; activations "
        f"{record['plan_activation_bytes_predicted'] / mb:.4g} MB predicted, "
        f"{record['plan_activation_bytes_saved'] / mb:.4g} MB saved for backward at peak"
    )
