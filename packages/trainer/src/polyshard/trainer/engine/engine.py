"""The runtime: this rank's share of the model laid out on the mesh, and everything that steps it (built
by :func:`polyshard.trainer.engine.builder.build_engine`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import ops
from polyshard.cp import position_ids
from polyshard.dp import (
    DataParallelWrapper,
    ZeroOptimizer,
)
from polyshard.mesh import Mesh, TensorPlacement
from polyshard.models import layer_of, output_width, spec_of, tied_names
from polyshard.models.common.mtp import PredictionInputs
from polyshard.pp import PipelineExecutor, SideInputs, Stage, StepResult
from polyshard.tp import (
    is_sequence_parallel,
)
from polyshard.trainer.config import Config
from polyshard.trainer.engine.context import local_tokens
from polyshard.trainer.engine.documents import documents_of, microbatch_documents
from polyshard.trainer.engine.layout import global_names
from polyshard.trainer.engine.mtp import microbatch_predictions, prediction_modules
from polyshard.trainer.errors import TiedWeightError
from polyshard.trainer.tasks import task_of
from polyshard.trainer.tasks.loss import TokenMeanLoss

T = TypeVar("T")


@dataclass
class Engine:
    """This rank's share of the model and everything that steps it."""

    config: Config
    mesh: Mesh
    stages: dict[int, Stage]  # pipeline stage index -> the plain stage (its layers, polyshard.pp.Stage)
    layer_ids: dict[int, range]  # pipeline stage index -> its global layer indices
    wrappers: dict[int, DataParallelWrapper]  # pipeline stage index -> its data-parallel wrapper
    optimizers: list[torch.optim.Optimizer | ZeroOptimizer]
    executor: PipelineExecutor
    tied_group: dist.ProcessGroup | None = None  # the pipeline ranks holding copies of a tied weight
    pipeline_layers: int = 0  # layers of the whole model (every stage's), numbered as layer_ids numbers them
    # Multi-token prediction (model.mtp_depth > 0): each depth's loss function on the last stage's rank (engine.mtp)
    mtp_loss_fns: list[TokenMeanLoss] = field(default_factory=list)
    _names: dict[int, dict[str, str]] = field(default_factory=dict, repr=False)  # see global_names

    @property
    def device(self) -> torch.device:
        return next(p for stage in self.stages.values() for p in stage.parameters()).device

    @property
    def holds_last_stage(self) -> bool:
        return self.executor.schedule.num_stages - 1 in self.stages

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stages

    # -- narrow answers about the run, so the loop need not read the config or the executor ------------------

    @property
    def num_microbatches(self) -> int:
        return self.executor.schedule.num_microbatches

    @property
    def loss_fn(self) -> Callable[..., torch.Tensor]:
        """The task's training loss, as the executor calls it on the last stage's output."""
        return self.executor.loss_fn

    @property
    def replicas(self) -> int:
        """Ranks that each hold a part of the global batch's loss (dp x ep x cp): the loss sums over them."""
        return self.config.parallel.replicas

    @property
    def replica_group(self) -> dist.ProcessGroup:
        """The group of those ranks (:attr:`replicas`) around this one."""
        return self.mesh.group(self.config.parallel.replica_axes)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel group, None without cp."""
        return self.mesh.group("cp") if self.config.parallel.cp > 1 else None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel group, None without tp."""
        return self.mesh.group("tp") if self.config.parallel.tp > 1 else None

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-3: each dp rank holds only its rows of the parameters (the stages' own are freed)."""
        return self.config.parallel.zero_stage == 3

    @property
    def has_experts(self) -> bool:
        """An MoE model: a step counts its experts' load (engine.balance)."""
        return spec_of(self.config.model).has_experts

    @property
    def vocab_width(self) -> int:
        """The output head's real width (the vocabulary or the classes), without tp's padding."""
        return output_width(self.config.model)

    @property
    def reports_accuracy(self) -> bool:
        """Whether the task's evaluation reports an accuracy beside the loss (classification)."""
        return task_of(self.config.model).reports_accuracy

    @property
    def loss_counts_tokens(self) -> bool:
        """Whether the training loss is a mean over the global batch's counted tokens, told their count
        per microbatch through ``forward_backward(tokens=...)`` (a TokenMeanLoss; the ViT's is not)."""
        return isinstance(self.executor.loss_fn, TokenMeanLoss)

    def local_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of a batch along the sequence: its cp chunks (all of it without cp)."""
        return local_tokens(tokens, self.cp_group)

    def forward_backward(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        segments: torch.Tensor | None = None,
        shifted: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        tokens: float | None = None,
        mtp_tokens: Sequence[float | None] = (),
    ) -> StepResult:
        """Run one step's microbatches; returns the executor's result: this data rank's mean loss on the
        last stage (else None) and this rank's timeline.
        ``segments``: the inputs' document ids, whole rows (document masking; see engine.documents).
        ``shifted``: multi-token prediction's inputs and targets, this rank's chunks (see engine.mtp).
        ``tokens`` / ``mtp_tokens``: the counted tokens per microbatch of the global batch that the loss
        and each depth's loss divide by (:func:`polyshard.trainer.tasks.loss.tokens_per_microbatch`;
        None: each microbatch's own count; ``tokens`` only where :attr:`loss_counts_tokens`)."""
        num_microbatches = self.num_microbatches
        prediction = None
        if shifted is not None and self.mtp_loss_fns:
            counts = list(mtp_tokens) or [None] * len(self.mtp_loss_fns)
            prediction = microbatch_predictions(*shifted, self.mtp_loss_fns, counts, num_microbatches)
        loss_fn = self.executor.loss_fn
        if tokens is not None:  # the caller asked loss_counts_tokens
            loss_fn = functools.partial(cast(TokenMeanLoss, loss_fn), tokens_per_microbatch=tokens)
        return self.executor.step(
            inputs if self.holds_first_stage else None,
            targets if self.holds_last_stage else None,
            side_inputs=self.side_inputs(segments, num_microbatches, prediction, length=inputs.shape[1]),
            loss_fn=loss_fn,
        )

    def forward_only(
        self, inputs: torch.Tensor, on_output: Callable[[torch.Tensor], T], segments: torch.Tensor | None = None
    ) -> T | None:
        """The stages forward, without gradients, on this rank's part of a batch (``inputs``: its cp chunks)
        as one microbatch, with its side inputs (cp's positions; the documents of ``segments``, whole
        rows); ``on_output(last stage's output)`` on the rank holding the last stage, else None."""
        side = self.side_inputs(segments, length=inputs.shape[1])
        return self.executor.forward_only(inputs if self.holds_first_stage else None, on_output, side_inputs=side)

    def take_mtp_losses(self) -> torch.Tensor | None:
        """Each prediction depth's loss summed over the step's microbatches on this rank (None: it holds
        no depths, or none ran); resets them."""
        taken = [module.take_losses() for module in prediction_modules(self.stages).values()]
        return next((t for t in taken if t is not None), None)

    def side_inputs(
        self,
        segments: torch.Tensor | None,
        num_microbatches: int = 1,
        prediction: Sequence[PredictionInputs] | None = None,
        *,
        length: int | None = None,
    ) -> SideInputs | None:
        """What each stage forward takes beside its activation, per microbatch (a stage hands each layer
        those it names; :mod:`polyshard.pp.stage`): the documents (``segments``: whole rows' document ids,
        with document masking), context parallelism's positions (of this rank's ``length`` tokens of each
        row: its chunks of rows of ``length`` x cp, whatever the rows' length), multi-token prediction's
        inputs. None when there is none of them."""
        parts: list[dict[str, Any]] = [{} for _ in range(num_microbatches)]
        cp = self.config.parallel.cp
        if cp > 1 and length is not None:
            positions = position_ids(length * cp, self.mesh.group("cp"), self.device)
            for part in parts:
                part["positions"] = positions
        if segments is not None:
            documents = documents_of(segments.to(self.device), self.local_tokens)
            for part, mine in zip(parts, microbatch_documents(documents, num_microbatches)):
                part["documents"] = mine
        for part, inputs in zip(parts, prediction or ()):
            part["prediction"] = inputs
        if not any(parts):
            return None
        return lambda stage, microbatch: parts[microbatch]

    def finish_gradients(self) -> None:
        for wrapper in self.wrappers.values():
            wrapper.finish_grad_sync()
        if self.config.parallel.tp > 1:
            # Norms on a sequence shard (sequence parallelism) and q/k norms on this rank's heads see
            # part of the work: sum their gradients over tp. Read the reduced gradient the optimizer
            # steps (under bf16 it lives in the fp32 bucket and p.grad stays None).
            grads = [
                wrapper.grad_shard(p)
                for wrapper in self.wrappers.values()
                for _, p in wrapper.owned_params()
                if is_sequence_parallel(p)
            ]
            ops.all_reduce_coalesced([g for g in grads if g is not None], self.mesh.group("tp"))
        self._sum_tied_copies()

    def tied_copies(self) -> dict[str, list[tuple[int, nn.Parameter]]]:
        """Tied weight name -> (stage index, parameter) of every copy this rank holds. A tied pair
        in one stage is one parameter; in two stages (first and last pipeline stage) each holds a copy."""
        tied = set(tied_names(self.config.model).values())
        out: dict[str, list[tuple[int, nn.Parameter]]] = {}
        for index, stage in self.stages.items():
            names = self.global_names(index)
            for local, p in stage.named_parameters():
                if names[local] in tied and p.requires_grad:  # a frozen tied weight needs no sync
                    out.setdefault(names[local], []).append((index, p))
        return out

    def _sum_tied_copies(self) -> None:
        """Megatron-LM's embedding-group all-reduce: every copy of a tied weight gets the sum of all
        copies' gradients (already averaged over the data ranks), so the copies, stepped alike from
        equal values, stay equal, and each equals the one tensor a single process would train."""
        if self.executor.schedule.num_stages == 1:
            return  # the tied pair is one parameter of the only stage
        for name, copies in sorted(self.tied_copies().items()):
            grads = [self.wrappers[index].grad_shard(p) for index, p in copies]
            index, param = copies[0]
            total = torch.zeros(self.wrappers[index].shard_spec(param).shard_shape, device=self.device)
            for grad in (g for g in grads if g is not None):
                total += grad.float()
            # The count of copies without a gradient travels with the sum, so both ends raise together.
            flat = torch.cat(
                [total.reshape(-1), torch.tensor([float(sum(g is None for g in grads))], device=self.device)]
            )
            if self.tied_group is not None:
                ops.all_reduce(flat, self.tied_group)
            if flat[-1] > 0:
                raise TiedWeightError(
                    f"a copy of the tied weight {name!r} got no gradient this step (seen on rank {self.mesh.rank}); "
                    "the embedding and the output head must both run in every training step"
                )
            for grad in cast(list[torch.Tensor], grads):  # every copy has one: the check above raised otherwise
                grad.copy_(flat[:-1].view_as(grad))

    def gradients(self) -> tuple[list[tuple[torch.Tensor, TensorPlacement]], list[torch.Tensor]]:
        """After finish_gradients: (gradient, placement record) for every gradient this rank holds,
        and apart from them the gradients of second copies of tied weights (the last stage's copy of
        a tied embedding), which the global norm must not count twice but clipping must scale."""
        pairs, copies = [], []
        for index, wrapper in self.wrappers.items():
            names = self.global_names(index)
            for name, p in wrapper.owned_params():
                # The reduced gradient the optimizer will read: the whole one at stage 0 (where ``p.grad``
                # is a view of it, or None under bf16), this rank's rows under ZeRO.
                grad = wrapper.grad_shard(p)
                if grad is None:
                    continue
                if layer_of(names[name]) in self.layer_ids[index]:
                    pairs.append((grad, wrapper.shard_placement(p, name)))
                else:
                    copies.append(grad)
        return pairs, copies

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for wrapper in self.wrappers.values():
            wrapper.zero_grad(set_to_none=True)

    def global_names(self, stage_index: int) -> dict[str, str]:
        """Chunk-local parameter name ('0.attn.q_proj.weight') -> model name ('layers.3.attn.q_proj.weight').
        Worked out once per stage (a stage's modules do not change after it is built): every step reads it."""
        if stage_index not in self._names:
            stage, layers = self.stages[stage_index], self.layer_ids[stage_index]
            self._names[stage_index] = global_names(stage, layers, tied_names(self.config.model))
        return self._names[stage_index]
