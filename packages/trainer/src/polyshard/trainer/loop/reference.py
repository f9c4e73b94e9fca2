"""The reference model of DPO and GRPO on the training mesh: the starting weights, frozen, laid out as the policy is.

Without LoRA it is a copy of this rank's stages taken before the first step (each parameter cloned,
``requires_grad`` off: no gradient, no dp bucket, no optimizer state), run by a pipeline executor of its
own with the policy's schedule, forward only: the pipeline ranks pass its activations as they pass the
policy's, the tp ranks split it as they split the policy.

Under ZeRO-3 the policy's stages hold only this rank's rows of each block (a unit's ``local``), gathered
around the block's forward. The reference is then those rows copied before the first step (each rank
holds its rows of the reference alone: memory stays sharded), and its forward is the policy's own
wrappers with every unit's rows swapped for the reference's: each block gathers the reference's rows
around its forward as it gathers the policy's, and the policy's rows are back before anything else runs.

With LoRA the frozen base *is* the starting model: the reference is the policy itself with every
adapter's scale set to 0 for its forward (``base(x) + 0 x update`` is ``base(x)`` exactly), so no second
copy exists, on any layout.

Each step :meth:`Reference.logps` runs this data rank's whole batch through it in eval mode (no
dropout) and returns each row's completion log-probability on the rank holding the last stage.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.dp import FullyShardedDataParallel
from polyshard.dp.units import Unit
from polyshard.models import output_width
from polyshard.pp import PipelineExecutor
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.tasks.dpo import sequence_logps
from polyshard.trainer.tasks.loss import token_logps


def _groups_of(stage: nn.Module) -> dict[int, Any]:
    """Every process group a module of ``stage`` holds (directly, or in a tuple/list): shared, not copied."""
    memo: dict[int, Any] = {}
    for module in stage.modules():
        for value in vars(module).values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, dist.ProcessGroup):
                    memo[id(item)] = item
    return memo


def frozen_copy(stage: nn.Module) -> nn.Module:
    """A copy of ``stage`` with cloned, frozen parameters (a Parameter's deepcopy drops its grad hooks)."""
    copied = copy.deepcopy(stage, memo=_groups_of(stage))
    for param in copied.parameters():
        param.requires_grad_(False)
    return copied.eval()


@contextlib.contextmanager
def _adapters_off(stages: Mapping[int, nn.Module]) -> Iterator[None]:
    adapted = [m for stage in stages.values() for m in stage.modules() if hasattr(m, "lora_scale")]
    scales = [m.lora_scale for m in adapted]
    for module in adapted:
        setattr(module, "lora_scale", 0.0)  # noqa: B010  (a float beside the modules, as models.common.lora sets it)
    try:
        yield
    finally:
        for module, scale in zip(adapted, scales):
            setattr(module, "lora_scale", scale)  # noqa: B010


def _at_rest(units: list[Unit]) -> None:
    """Every unit holds its rows alone: no prefetch in flight, nothing gathered (a kept output head stays
    gathered after a forward without backward), so the next gather reads whichever rows are ``local``."""
    for unit in units:
        unit.drop_prefetch()
        unit.free()


class ShardedRows:
    """Under ZeRO-3: this rank's rows of the starting weights (a copy of every unit's ``local`` of the
    policy's wrappers) and the stages' buffers as they were, swapped in for the reference's forward."""

    def __init__(self, engine: Engine):
        wrappers = [cast(FullyShardedDataParallel, w) for w in engine.wrappers.values()]  # zero_stage = 3
        self.units = [u for w in wrappers for u in (*w.reduce_order, *w.frozen_units, *w.frozen_roots)]
        self.rows = [unit.local.detach().clone() for unit in self.units]
        # A buffer the run updates (a router's bias) is the starting model's too.
        self.buffers = [b for stage in engine.stages.values() for b in stage.buffers()]
        self.buffer_values = [b.detach().clone() for b in self.buffers]

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        _at_rest(self.units)
        policy_rows = [unit.local for unit in self.units]
        policy_buffers = [b.detach().clone() for b in self.buffers]
        with torch.no_grad():
            for unit, rows in zip(self.units, self.rows):
                unit.local = rows
            for buffer, value in zip(self.buffers, self.buffer_values):
                buffer.copy_(value)
        try:
            yield
        finally:
            _at_rest(self.units)  # nothing gathered from the reference's rows outlives its forward
            with torch.no_grad():
                for unit, rows in zip(self.units, policy_rows):
                    unit.local = rows
                for buffer, value in zip(self.buffers, policy_buffers):
                    buffer.copy_(value)


class Reference:
    """The frozen starting model of ``engine``'s policy (built before its first step)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        config = engine.config
        self.tp_group = engine.mesh.group("tp") if config.parallel.tp > 1 else None
        self.vocab_size = output_width(config.model)
        self.stages: dict[int, nn.Module] = {}
        self.rows: ShardedRows | None = None
        self.executor = engine.executor
        if config.lora is None and config.parallel.zero_stage == 3:
            self.rows = ShardedRows(engine)
        elif config.lora is None:
            self.stages = {index: frozen_copy(stage) for index, stage in engine.stages.items()}
            self.executor = PipelineExecutor(
                self.stages,
                engine.executor.schedule,
                engine.executor.loss_fn,  # never called: the reference runs forward only
                engine.mesh.group("pp"),
            )

    def logps(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """(B,) each row's completion log-prob under the reference (float32), on the rank holding the last
        stage, else None. ``inputs`` and ``labels`` (B, S): this data rank's whole batch."""
        return self._forward(inputs, lambda logits: sequence_logps(logits, labels, self.tp_group, self.vocab_size))

    def token_logps(
        self, inputs: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0
    ) -> torch.Tensor | None:
        """(B, S) each label's log-prob under the reference's softmax(logits / temperature) (0 where a label
        counts nothing), on the rank holding the last stage, else None (GRPO's KL term)."""
        return self._forward(
            inputs, lambda logits: token_logps(logits, labels, self.tp_group, self.vocab_size, temperature=temperature)
        )

    def _forward(self, inputs: torch.Tensor, score: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        side = self.engine.side_inputs(None, length=inputs.shape[1])
        first = inputs if self.engine.holds_first_stage else None
        policy_stages = self.engine.stages
        if self.stages:
            return self.executor.forward_only(first, score, side_inputs=side)
        modes = [stage.training for stage in policy_stages.values()]
        for stage in policy_stages.values():
            stage.eval()
        try:
            with self.rows.swapped_in() if self.rows is not None else _adapters_off(policy_stages):
                return self.executor.forward_only(first, score, side_inputs=side)
        finally:
            for stage, mode in zip(policy_stages.values(), modes):
                stage.train(mode)

    def parameters(self) -> Iterator[torch.Tensor]:
        """The copy's parameters, or under ZeRO-3 this rank's rows of them (none with LoRA: the base is the
        policy's own)."""
        for stage in self.stages.values():
            yield from stage.parameters()
        if self.rows is not None:
            yield from self.rows.rows
