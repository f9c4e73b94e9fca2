"""One executor that runs any lowered schedule on real stages.

forward: microbatch k enters stage 0, each F sends its output on; the last
stage computes ``loss_fn(output, target_k) / m``, so with a mean-reducing
loss and equal microbatches the summed gradient equals the full-batch mean
gradient. backward: a BACKWARD receives the gradient of its output,
backpropagates and sends the gradient of its input; a BACKWARD_INPUT does the
same for the input gradient only and keeps the graph, and its BACKWARD_WEIGHT
later computes the weight gradients (zero-bubble split). Gradients accumulate in ``.grad``;
zero them between steps as usual.

Communication follows the lowered program (:mod:`polyshard.pp.lowering`): each
receive is posted ``prefetch`` compute actions before the one that reads it
(one by default on gloo) and waited for just before that action; sends are
posted right after the action that produced them and waited for only at the
end of the step. So activations and gradients travel while both sides compute.

``backward_context`` (optional) is a factory of context managers entered
around every action that accumulates weight gradients except the last one
of the step on this rank - e.g. a data-parallel wrapper's ``no_sync``, so
its reduction runs once, overlapped with the last backward. pp knows
nothing about dp.

``side_inputs`` (optional, per call of :meth:`~PipelineExecutor.step` or
:meth:`~PipelineExecutor.forward_only`) is a function ``(stage, microbatch) -> keyword
arguments`` of that stage's forward on that microbatch: how a caller hands a stage
per-microbatch inputs that do not travel between stages (every rank has them, e.g.
the document ids of each microbatch's tokens; a :class:`~polyshard.pp.stage.Stage`
gives each layer the ones it takes). pp knows nothing about them.

The shapes that travel between stages are inferred on the first step, so
later steps must keep the same microbatch shape (build a new executor
otherwise). :meth:`PipelineExecutor.forward_only` runs the same stages
forward only, for evaluation, on batches of any size.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import ops, p2p
from polyshard.collectives.ledger import record
from polyshard.pp.actions import Action, Exchange, Kind, Schedule, Step, Wait, activation, gradient
from polyshard.pp.errors import ScheduleError, StageShapeError
from polyshard.pp.lowering import DEFAULT_PREFETCH, Program, lower, peer_of
from polyshard.pp.schedules import forward_only
from polyshard.pp.shapes import Meta, infer_shapes
from polyshard.pp.simulator import simulate
from polyshard.pp.split import WeightWork, backward_input, backward_weight
from polyshard.pp.timeline import Span, Timeline

T = TypeVar("T")
SideInputs = Callable[[int, int], Mapping[str, Any]]
"""(stage, microbatch) -> the keyword arguments of that stage's forward on that microbatch."""


@dataclass
class StepResult:
    loss: torch.Tensor | None  # full-batch mean loss on the rank holding the last stage, else None
    timeline: Timeline  # this rank's spans (perf_counter seconds; see gather_timeline for all ranks)
    peak_activations: int  # most (stage, microbatch) activations stored at once (F done, B not yet)


class PipelineExecutor:
    """Runs ``schedule`` on this rank's ``stages`` ({stage index: module}) over ``group``."""

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        schedule: Schedule,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        group: dist.ProcessGroup | None = None,
        *,
        backward_context: Callable[[], AbstractContextManager[object]] | None = None,
        prefetch: int | None = None,
    ):
        self.rank, size = dist.get_rank(group), dist.get_world_size(group)
        if size != schedule.num_ranks:
            raise ScheduleError(f"schedule is for {schedule.num_ranks} ranks but the pp group has {size}")
        if sorted(stages) != schedule.stages_of(self.rank):
            raise ScheduleError(
                f"rank {self.rank} holds stages {sorted(stages)} but the schedule puts "
                f"{schedule.stages_of(self.rank)} on it"
            )
        if prefetch is None:
            # gloo completes each operation of a batch on its own, so a receive posted early is waited
            # for alone. A backend that completes a batch as a whole (NCCL coalesces it) would make that
            # wait cover the batch's sends too, so there a receive is posted right before it is needed.
            prefetch = DEFAULT_PREFETCH if dist.get_backend(group) == "gloo" else 0
        self.program: Program = lower(schedule, prefetch)
        # raises DeadlockError (naming rank and action) before any tensor moves
        simulate(schedule, program=self.program)
        self.stages, self.schedule, self.loss_fn, self.group = dict(stages), schedule, loss_fn, group
        self.backward_context = backward_context
        self.steps = self.program[self.rank]
        self.peers = [dist.get_global_rank(group, r) if group is not None else r for r in range(size)]
        self.shapes: dict[int, tuple[Meta, Meta]] = {}  # stage -> (input meta, output meta), inferred on the first step
        # State of the step in progress (set by step()):
        self.microbatches: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.side_inputs: SideInputs | None = None
        self.step_loss_fn = loss_fn  # this step's loss (step()'s loss_fn, or the executor's)
        self.loss: torch.Tensor | None = None
        self.pending_sends: list[tuple[list[dist.Work], torch.Tensor]] = []
        self.incoming: dict[Action, tuple[torch.Tensor, list[dist.Work]]] = {}  # posted receive -> (buffer, work)
        params = [q for stage in self.stages.values() for q in stage.parameters()]
        self.device = params[0].device if params else torch.device("cpu")  # where receive buffers live
        self.forward_steps: tuple[Step, ...] | None = None  # the forward-only program, lowered on first use
        weight_steps = [
            i for i, s in enumerate(self.steps) if isinstance(s, Action) and s.kind.accumulates_weight_grads
        ]
        self.last_weight_step = weight_steps[-1] if weight_steps else -1
        # Worked out once, not at every step: each step's timeline label and kind, each message's peer.
        self.labels = [(str(step), span_kind(step)) for step in self.steps]
        self.peer_ranks = {
            op: self.peers[peer_of(schedule, op)] for s in self.steps if isinstance(s, Exchange) for op in s.ops
        }

    def _split(self, tensor: torch.Tensor | None, what: str) -> list[torch.Tensor] | None:
        m = self.schedule.num_microbatches
        if tensor is None:
            return None
        if tensor.shape[0] % m:
            raise StageShapeError(f"{what} has batch size {tensor.shape[0]}, not divisible by m={m} microbatches")
        return list(tensor.chunk(m))

    def step(
        self,
        inputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        side_inputs: SideInputs | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> StepResult:
        """One training step. ``inputs`` are needed on stage 0's rank, ``targets`` on the last stage's.
        ``side_inputs``: see the module docstring (microbatch k is chunk k of the batch along dim 0).
        ``loss_fn``: this step's loss, e.g. one told the global batch's token count (default: the
        executor's)."""
        last = self.schedule.num_stages - 1
        if 0 in self.stages and inputs is None or last in self.stages and targets is None:
            raise StageShapeError(f"rank {self.rank} holds stage 0 or {last}: pass inputs / targets to step()")
        self.microbatches = self._split(inputs, "inputs") or []
        self.targets = self._split(targets, "targets") or []
        self.side_inputs = side_inputs
        self.step_loss_fn = loss_fn if loss_fn is not None else self.loss_fn
        if not self.shapes:
            first = self.microbatches[0] if self.microbatches else None
            self.shapes = infer_shapes(self.stages, self.schedule, first, self.group, self.peers, self.device)
        # message key -> tensor, for local hand-offs and receives
        self.mail: dict[Action, torch.Tensor] = {}
        # (stage, mb) -> (input, output or loss)
        self.stored: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # (stage, mb) -> what its W needs, left by its input-half backward
        self.awaiting_w: dict[tuple[int, int], WeightWork] = {}
        self.loss, self.peak, self.pending_sends, spans = None, 0, [], []
        for index, step in enumerate(self.steps):
            start = time.perf_counter()
            if isinstance(step, Exchange):
                self._post(step)
            elif isinstance(step, Wait):
                self._wait(step)
            else:
                self._compute(step, index)
            spans.append(Span(self.rank, *self.labels[index], start, time.perf_counter()))
        for handle, _ in self.pending_sends:
            for work in handle:
                work.wait()
        self.side_inputs, self.step_loss_fn = None, self.loss_fn  # the step's own are not kept past it
        timeline = Timeline(self.schedule.num_ranks, tuple(spans), with_stage=self.schedule.virtual_stages > 1)
        return StepResult(self.loss, timeline, self.peak)

    def forward_only(
        self,
        inputs: torch.Tensor | None,
        on_output: Callable[[torch.Tensor], T],
        *,
        side_inputs: SideInputs | None = None,
    ) -> T | None:
        """Run the schedule's forward-only program (:func:`polyshard.pp.schedules.forward_only`): every
        stage once on the whole batch, without gradients, for evaluation. Unlike :meth:`step` the batch
        may have any size on every call (an empty one included): activations travel behind a shape
        header. ``inputs`` are needed on stage 0's rank; returns ``on_output(last stage's output)`` on
        the rank holding the last stage, else None. ``side_inputs`` as in :meth:`step`, with
        microbatch 0: the whole batch."""
        if 0 in self.stages and inputs is None:
            raise StageShapeError(f"rank {self.rank} holds stage 0: pass inputs to forward_only()")
        if self.forward_steps is None:  # (the simulator checks training steps; this chain cannot deadlock)
            # prefetch=0: each exchange receives (header, then tensor) what the next forward reads
            self.forward_steps = lower(forward_only(self.schedule), prefetch=0)[self.rank]
        mail: dict[Action, torch.Tensor] = {}
        result, pending = None, []
        with torch.no_grad():
            for step in self.forward_steps:
                if isinstance(step, Exchange):
                    pending += self._exchange_with_headers(step, mail)
                    continue
                if isinstance(step, Wait):  # the exchange before it has received already
                    continue
                x = inputs if step.stage == 0 else mail.pop(activation(step.stage - 1, 0))
                y = self.stages[step.stage](x, **(side_inputs(step.stage, 0) if side_inputs is not None else {}))
                if step.stage == self.schedule.num_stages - 1:
                    result = on_output(y)
                else:
                    mail[activation(step.stage, 0)] = y
        for work, _ in pending:
            work.wait()
        return result

    def _exchange_with_headers(
        self, step: Exchange, mail: dict[Action, torch.Tensor]
    ) -> list[tuple[dist.Work, torch.Tensor]]:
        """An exchange whose receivers do not know the shapes: headers first, then the tensors."""
        sends, recvs = [], []
        for op in step.ops:
            key = op.message_key()
            if op.kind is Kind.SEND_FORWARD:
                sends.append((mail.pop(key).contiguous(), self.peers[self.schedule.rank_of(key.stage + 1)]))
            else:
                recvs.append((key, self.peers[self.schedule.rank_of(key.stage)]))
        # Every send (header, then tensor) is posted at once and never waited on here: a rank whose
        # exchange also receives must not hold back what its neighbour needs to produce that input.
        outgoing = [(p2p.header_of(t), dst) for t, dst in sends] + sends
        headers = [(torch.empty(p2p.HEADER_NUMEL, dtype=torch.int64, device=self.device), src) for _, src in recvs]
        pending = p2p.exchange(outgoing, headers, self.group, wait_sends=False)
        buffers = [(p2p.buffer_for(header, self.device), src) for header, src in headers]
        pending += p2p.exchange([], buffers, self.group, wait_sends=False)
        mail.update({key: buffer for (key, _), (buffer, _) in zip(recvs, buffers)})
        return pending

    def _post(self, step: Exchange) -> None:
        """Post the step's sends and receives as one batch of isend/irecv; nothing waits here. Sends
        finish in the background (waited for at the end of the step); receives when a Wait needs them."""
        batch, tensors = [], []
        for op in step.ops:
            peer = self.peer_ranks[op]
            if op.kind.is_send:
                tensor = self.mail.pop(op).contiguous()
                record("send", self.group, tensor.numel() * tensor.element_size(), peer=peer)
                batch.append(dist.P2POp(dist.isend, tensor, peer, self.group))
            else:
                # a received activation has the sender's output shape; a gradient has this stage's output shape
                shape, dtype = self.shapes[op.stage][0 if op.kind is Kind.RECV_FORWARD else 1]
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                record("recv", self.group, tensor.numel() * tensor.element_size(), wire_bytes=0.0, peer=peer)
                batch.append(dist.P2POp(dist.irecv, tensor, peer, self.group))
            tensors.append(tensor)
        works = dist.batch_isend_irecv(batch)
        # gloo returns one handle per operation; a backend that coalesces the batch returns handles that
        # complete with every operation in it, so each operation waits for all of them
        handles = [[work] for work in works] if len(works) == len(batch) else [list(works)] * len(batch)
        for op, tensor, handle in zip(step.ops, tensors, handles):
            if op.kind.is_send:
                self.pending_sends.append((handle, tensor))  # the tensor stays referenced until sent
            else:
                self.incoming[op] = (tensor, handle)

    def _wait(self, step: Wait) -> None:
        for op in step.ops:
            buffer, works = self.incoming.pop(op)
            for work in works:
                work.wait()
            self.mail[op.message_key()] = buffer

    def _compute(self, action: Action, index: int) -> None:
        if action.kind is Kind.FORWARD:
            self._forward(action.stage, action.microbatch)
            return
        hook = self.backward_context
        inside = action.kind.accumulates_weight_grads and index != self.last_weight_step
        with hook() if hook is not None and inside else contextlib.nullcontext():
            if action.kind is Kind.BACKWARD_WEIGHT:
                self._weight_grad(action.stage, action.microbatch)
            else:
                self._backward(action.stage, action.microbatch, split=action.kind is Kind.BACKWARD_INPUT)

    def _forward(self, stage: int, k: int) -> None:
        if stage == 0:
            x = self.microbatches[k]
        else:
            x = self.mail.pop(activation(stage - 1, k)).detach().requires_grad_()
        side = self.side_inputs
        y = self.stages[stage](x, **(side(stage, k) if side is not None else {}))
        if stage == self.schedule.num_stages - 1:
            y = self.step_loss_fn(y, self.targets[k]) / self.schedule.num_microbatches
            self.loss = y.detach() if self.loss is None else self.loss + y.detach()
        else:
            self.mail[activation(stage, k)] = y.detach()
        self.stored[(stage, k)] = (x, y)
        self.peak = max(self.peak, len(self.stored))

    def _backward(self, stage: int, k: int, split: bool) -> None:
        x, y = self.stored.pop((stage, k))
        grad = None if stage == self.schedule.num_stages - 1 else self.mail.pop(gradient(stage + 1, k))
        if split:  # input gradient only; what W needs is kept (see polyshard.pp.split)
            input_grad, self.awaiting_w[(stage, k)] = backward_input(y, grad, x, list(self.stages[stage].parameters()))
            if input_grad is not None:
                x.grad = input_grad
        else:
            torch.autograd.backward(y, grad)
        if stage > 0:
            self.mail[gradient(stage, k)] = cast(torch.Tensor, x.grad)  # x is a received activation that requires grad

    def _weight_grad(self, stage: int, k: int) -> None:
        # backward(inputs=...) accumulates into .grad like any backward, so post-accumulate-grad
        # hooks (a data-parallel reducer's) fire for W exactly as they do for an unsplit B.
        backward_weight(self.awaiting_w.pop((stage, k)))


def span_kind(step: Step) -> str:
    """How a step shows on a timeline: F/B/W compute, X posting sends/receives, R waiting for data."""
    if isinstance(step, Exchange):
        return "X"
    if isinstance(step, Wait):
        return "R"
    return step.kind.letter


def gather_timeline(
    local: Timeline,
    schedule: Schedule,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    *,
    program: Program | None = None,
) -> Timeline:
    """Every rank's spans of one step, on every rank (for rendering the whole pipeline).

    Spans follow each rank's lowered steps in order, so only (start, end) pairs
    travel; labels are rebuilt from the schedule. Times are ``perf_counter``
    readings, which share one clock between processes on the same host.
    ``device`` is where the gathered buffer lives (a GPU under NCCL); ``program`` is the lowered
    program the executor ran (``executor.program``; by default the gloo one, ``lower(schedule)``).
    """
    program = lower(schedule) if program is None else program
    longest = max(len(steps) for steps in program)
    times = torch.full((1, longest, 2), float("nan"), dtype=torch.float64, device=device)
    times[0, : len(local.spans)] = torch.tensor([[s.start, s.end] for s in local.spans], dtype=torch.float64)
    every = ops.all_gather(times, 0, group).cpu()  # (p, longest, 2)
    spans = []
    for rank, steps in enumerate(program):
        for step, (start, end) in zip(steps, every[rank].tolist()):
            spans.append(Span(rank, str(step), span_kind(step), start, end))
    return Timeline(schedule.num_ranks, tuple(spans), with_stage=schedule.virtual_stages > 1)
