"""Compose the strategies on one model: TP -> EP -> PP -> DP/ZeRO, for any subset of axes.

The mesh axes are ``pp x dp x ep x cp x tp`` (tp fastest). The order matters:

1. **TP** converts the full model's linears and embeddings in place
   (:func:`polyshard.tp.parallelize`), so every rank starts from the same
   seeded weights and keeps its slice; names stay global.
2. **EP** keeps this rank's experts (:func:`polyshard.ep.apply_expert_parallel`).
3. **PP** cuts ``model.layers`` into contiguous stages (balanced by parameter
   count) and keeps this rank's; one :class:`polyshard.pp.PipelineExecutor`
   runs every step, even with one stage, so microbatching and gradient
   accumulation have a single code path.
4. **DP/ZeRO** wraps each stage: :class:`polyshard.dp.DataParallel` (stages
   0-2) or :class:`polyshard.dp.FullyShardedDataParallel` (stage 3).
   Non-expert gradients average over dp x ep x cp (every replica: the data
   ranks and the cp ranks that split their sequences); expert gradients
   reduce over the ranks holding the same experts, dp x cp, and are divided
   by dp x ep x cp, because each expert already summed its gradient over the
   ep ranks' tokens. Worked example, dp=1 x ep=2 x cp=2 (ranks (ep, cp):
   0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1)): experts 0..E/2 live on ranks 0 and 1,
   whose sum holds every rank's tokens once; divided by 4 it is the mean the
   replicated parameters average to over all four ranks.
   Under cp, each MoE layer computes its auxiliary losses and applies the
   capacity rule over the cp group's tokens
   (:func:`polyshard.ep.share_routing_statistics`): the whole sequences',
   what the same data rank without cp computes.
   Hybrid sharding (``parallel.dp_shard``): ZeRO shards over dp_shard (x ep x
   cp for non-expert parameters, x cp for experts) and each shard is
   all-reduced across dp_replicate.

pp x dp: the executor enters dp's ``no_sync`` around every backward but the
last, so each bucket is reduced once per step, overlapped with the last
backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import ops
from polyshard.cp import position_ids
from polyshard.dp import (
    DataParallel,
    DataParallelWrapper,
    FullyShardedDataParallel,
    MixedPrecision,
    Muon,
    ParamSet,
    ZeroOptimizer,
)
from polyshard.ep import MoELayer, apply_expert_parallel, expert_parameters, share_routing_statistics
from polyshard.mesh import Mesh, TensorPlacement, get_placement, set_placement
from polyshard.pp import PipelineExecutor, Schedule, Timeline, balanced_partition, make_schedule
from polyshard.tp import (
    is_sequence_parallel,
)
from polyshard.tp import (
    parallelize as tp_parallelize,
)
from polyshard.trainer.config import Config
from polyshard.trainer.config.sections import SPLIT_BACKWARD
from polyshard.trainer.engine.compiling import compile_blocks
from polyshard.trainer.engine.context import apply_context_parallel, local_tokens
from polyshard.trainer.engine.documents import StageDocuments, documents_of
from polyshard.trainer.engine.optim import adamw_kernel, decay_rule, muon_groups, param_groups
from polyshard.trainer.errors import TiedWeightError
from polyshard.trainer.models import build_model, layer_of, sequence_length, spec_of, tied_names
from polyshard.trainer.models.tasks import LossFn


def tp_plan(config: Config, layers: Collection[int] | None = None) -> dict[str, Any]:
    """The model family's tensor-parallel plan (over names ``layers.{i}.attn.q_proj`` ...), for every
    pipeline layer or only ``layers``."""
    plan = spec_of(config.model).tp_plan(config.model, config.parallel)
    if layers is not None:
        plan = {pattern: style for pattern, style in plan.items() if layer_of(pattern) in layers}
    return plan


def pipeline_bounds(config: Config, shapes: Mapping[str, Sequence[int]]) -> list[range]:
    """Global layer indices of each pipeline stage: ``parallel.stage_layers`` when given, else
    balanced by :func:`layer_costs` of the global parameter ``shapes`` (this rank-independent
    split is what every rank, ``--dry-run`` and the offline resharder agree on)."""
    par = config.parallel
    if par.stage_layers is None:
        costs = layer_costs(shapes, tied_names(config.model))
        return balanced_partition(costs, par.pp * par.virtual_stages)
    bounds, start = [], 0
    for count in par.stage_layers:
        bounds.append(range(start, start + count))
        start += count
    return bounds


def loss_function(config: Config, mesh: Mesh, head: nn.Module | None = None) -> LossFn:
    """The last stage's loss, as the model's task defines it (vocabulary-parallel under tp). ``head``: the
    model's last layer where this rank holds it (a chunked loss projects with its weight)."""
    return spec_of(config.model).task.loss(config, mesh.group("tp") if config.parallel.tp > 1 else None, head)


@dataclass
class Engine:
    """This rank's share of the model and everything that steps it."""

    config: Config
    mesh: Mesh
    stages: dict[int, nn.Sequential]  # pipeline stage index -> the plain stage (nn.Sequential of layers)
    layer_ids: dict[int, range]  # pipeline stage index -> its global layer indices
    wrappers: dict[int, DataParallelWrapper]  # pipeline stage index -> its data-parallel wrapper
    optimizers: list[torch.optim.Optimizer | ZeroOptimizer]
    executor: PipelineExecutor
    tied_group: dist.ProcessGroup | None = None  # the pipeline ranks holding copies of a tied weight
    timeline: Timeline | None = None  # this rank's spans of the last training step (the executor's)
    pipeline_layers: int = 0  # layers of the whole model (every stage's), numbered as layer_ids numbers them
    # MoE models: every MoE layer's load in the last training step, by pipeline layer (engine.balance.LayerLoad)
    expert_load: dict[int, Any] = field(default_factory=dict)
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

    def local_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of a batch along the sequence: its cp chunks (all of it without cp)."""
        return local_tokens(tokens, self.mesh.group("cp") if self.config.parallel.cp > 1 else None)

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, segments: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Run one step's microbatches; returns this data rank's mean loss on the last stage, else None.
        ``segments``: the inputs' document ids, whole rows (document masking; see engine.documents)."""
        result = self.executor.step(
            inputs if self.holds_first_stage else None,
            targets if self.holds_last_stage else None,
            around_forward=self.around_forward(segments, self.executor.schedule.num_microbatches),
        )
        self.timeline = result.timeline
        return result.loss

    def around_forward(
        self, segments: torch.Tensor | None, num_microbatches: int = 1
    ) -> Callable[[int, int], contextlib.AbstractContextManager[None]] | None:
        """What the executor enters around each stage forward to set that microbatch's documents (None
        without document masking)."""
        if segments is None:
            return None
        documents = documents_of(segments.to(self.device), self.local_tokens)
        return StageDocuments(self.stages, documents, num_microbatches).around_forward

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


def global_names(stage: nn.Module, layer_ids: range, aliases: Mapping[str, str] | None = None) -> dict[str, str]:
    """Chunk-local names -> model names; a copy of a tied weight takes the weight's own name
    (``aliases``: alias -> name, see :func:`polyshard.trainer.models.tied_names`)."""
    aliases = aliases or {}
    out = {}
    for name, _ in stage.named_parameters():
        local, _, rest = name.partition(".")
        model_name = f"layers.{layer_ids[int(local)]}.{rest}"
        out[name] = aliases.get(model_name, model_name)
    return out


def _name_records_globally(stage: nn.Module, layer_ids: range, aliases: Mapping[str, str]) -> None:
    """Give every parameter a record under its model name and pipeline layer, so records (and
    checkpoints) never carry a stage-local name, whichever strategies touched it."""
    names = global_names(stage, layer_ids, aliases)
    for local, param in stage.named_parameters():
        record = get_placement(param)
        if record is None:
            record = TensorPlacement(names[local], tuple(param.shape))
        set_placement(param, dataclasses.replace(record, name=names[local], layer=layer_of(names[local])))


def _no_sync_all(wrappers: Sequence[DataParallelWrapper]) -> Callable[[], contextlib.ExitStack]:
    def context() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for wrapper in wrappers:
            stack.enter_context(wrapper.no_sync())
        return stack

    return context


def _wrap_data_parallel(stage: nn.Sequential, config: Config, mesh: Mesh) -> DataParallelWrapper:
    par = config.parallel
    mp = None
    if config.training.precision == "bf16":
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # The data-parallel group spans every replica axis (dp x ep x cp); records name each axis so
    # checkpoints and the gradient-norm clip know a ZeRO shard is split over each. Under hybrid sharding
    # ZeRO's group is the shard axes (dp_shard x ep x cp) and dp_replicate holds the shard's copies.
    shard_axes, replicate_axes = par.shard_axes, par.replicate_axes
    replicate_group = mesh.group(replicate_axes) if par.hybrid else None
    replicate_axis = replicate_axes if par.hybrid else None
    data_group = mesh.group(shard_axes)
    if par.zero_stage == 3:
        return FullyShardedDataParallel(
            stage,
            group=data_group,
            blocks=list(stage),
            mixed_precision=mp,
            axis=shard_axes,
            replicate_group=replicate_group,
            replicate_axis=replicate_axis,
        )
    sets = []
    experts = expert_parameters(stage) if spec_of(config.model).has_experts else []
    if experts:
        # Each expert's gradient already sums every ep rank's tokens: reduce over the ranks holding the
        # same experts (dp x cp; dp_shard x cp under hybrid sharding, then across dp_replicate), divide by
        # every replica (dp x ep x cp).
        expert_axes = par.expert_shard_axes
        sets.append(
            ParamSet(
                experts,
                group=mesh.group(expert_axes),
                divide_by=par.replicas,
                axis=expert_axes,
                replicate_group=replicate_group,
                replicate_axis=replicate_axis,
            )
        )
    # No buffer broadcast before each forward: the models' buffers (a sigmoid router's bias) are replicated
    # state every rank updates alike (engine.balance), and the replica check would not see a drift it hid.
    return DataParallel(
        stage,
        group=data_group,
        zero_stage=par.zero_stage,
        mixed_precision=mp,
        param_sets=sets,
        axis=shard_axes,
        replicate_group=replicate_group,
        replicate_axis=replicate_axis,
        broadcast_buffers=False,
    )


def _optimizer(
    wrapper: DataParallelWrapper, config: Config, names: Mapping[str, str], mesh: Mesh
) -> torch.optim.Optimizer | ZeroOptimizer:
    train, spec = config.training, spec_of(config.model)
    named = [(names[n], p) for n, p in wrapper.module.named_parameters()]
    decays, kernel = decay_rule(train, spec.decays), adamw_kernel(train)
    inner: torch.optim.Optimizer
    if train.optimizer == "muon":
        # Muon reads each stepped tensor's placement record (ZeRO's masters carry theirs) and gathers a
        # split matrix over the mesh axes the record names: see polyshard.dp.muon.
        inner = Muon(
            muon_groups(named, train.weight_decay, decays, spec.orthogonalised),
            mesh=mesh,
            lr=train.lr,
            momentum=train.muon_momentum,
            nesterov=train.muon_nesterov,
            ns_steps=train.muon_ns_steps,
            betas=(train.beta1, train.beta2),
            **kernel,
        )
    else:
        groups = param_groups(named, train.weight_decay, decays)
        inner = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), **kernel)
    if not keeps_masters(config):
        return inner  # gradients are full and averaged in place: a plain optimizer suffices
    return ZeroOptimizer(inner, wrapper)


def keeps_masters(config: Config) -> bool:
    """Whether a ZeroOptimizer steps fp32 master rows (ZeRO, or bf16 parameters) rather than the parameters.
    In fp32 those rows are views of the parameters (or ZeRO-3's shards), not copies; checkpoints still
    save them under ``optim/<name>/master``, as before."""
    return config.parallel.zero_stage > 0 or config.training.precision == "bf16"


def layer_costs(shapes: Mapping[str, Sequence[int]], aliases: Mapping[str, str] | None = None) -> list[int]:
    """Parameters per pipeline layer, from global parameter shapes: what the pipeline split balances.
    It does not depend on tp, ep or dp, so every layout with the same stages splits alike. A tied
    weight (``aliases``: alias -> name) counts in its alias's layer too: that layer computes with it,
    and on another stage holds a copy."""
    costs: dict[int, int] = {}
    for name, shape in shapes.items():
        costs[layer_of(name)] = costs.get(layer_of(name), 0) + math.prod(shape)
    for alias, name in (aliases or {}).items():
        if name in shapes:
            costs[layer_of(alias)] = costs.get(layer_of(alias), 0) + math.prod(shapes[name])
    return [costs[i] for i in sorted(costs)]


def build_engine(config: Config, mesh: Mesh, device: torch.device | str = "cpu") -> Engine:
    """Build this rank's pipeline layers and apply TP -> EP -> PP -> DP/ZeRO to them.

    Only this rank's layers are materialised; each is seeded by its global
    index (see :mod:`polyshard.trainer.models`), so every layout starts from the
    numbers one process would build.
    """
    par = config.parallel
    schedule = make_schedule(par.schedule, par.pp, par.microbatches, par.virtual_stages)
    skeleton = build_model(config.model, layers=())  # the meta device: shapes only
    bounds = pipeline_bounds(config, {n: p.shape for n, p in skeleton.named_parameters()})
    mine = schedule.stages_of(mesh.coord("pp"))
    owned = [i for s in mine for i in bounds[s]]
    full = build_model(
        config.model,
        seed=config.training.seed,
        layers=owned,
        device=device,
        checkpoint_activations=config.training.activation_checkpointing,
        aux_loss_scale=1.0 / par.microbatches,  # each microbatch's aux loss, like its CE, counts 1/m
        head_logits=config.training.loss_chunks <= 1,  # chunked: the loss projects the head's hidden states
    )
    model = nn.Module()  # this rank's layers under their global names: layers.<i>.…
    # A family's model keeps its pipeline layers in an nn.ModuleList (models.spec); torch types it Tensor | Module.
    model.layers = nn.ModuleDict({str(i): cast(nn.ModuleList, full.layers)[i] for i in owned})
    del full, skeleton
    if par.cp > 1:
        apply_context_parallel(model, mesh.group("cp"), par.cp_style, sequence_length(config.model), device)
    aliases = tied_names(config.model)
    _untie_across_stages(model, aliases, {i: s for s in mine for i in bounds[s]})
    if par.tp > 1:
        tp_parallelize(model, tp_group=mesh.group("tp"), plan=tp_plan(config, owned))
    if any(isinstance(m, MoELayer) for m in model.modules()):
        apply_expert_parallel(model, group=mesh.group("ep"))
        if par.cp > 1:  # each cp rank routes its chunks; aux losses and capacity are the whole sequences'
            positions = position_ids(sequence_length(config.model), mesh.group("cp"), device)
            share_routing_statistics(model, group=mesh.group("cp"), positions=positions)
    stages = {s: nn.Sequential(*(model.layers[str(i)] for i in bounds[s])) for s in mine}
    for s, stage in stages.items():
        _name_records_globally(stage, bounds[s], aliases)
    wrappers = {s: _wrap_data_parallel(stage, config, mesh) for s, stage in stages.items()}
    if config.training.compile:
        # After every strategy has replaced its modules and set its hooks: only block forwards compile.
        compile_blocks(stages.values(), retain_graph=par.schedule in SPLIT_BACKWARD)
    optimizers = [_optimizer(w, config, global_names(stages[s], bounds[s], aliases), mesh) for s, w in wrappers.items()]
    executor = PipelineExecutor(
        cast(Mapping[int, nn.Module], wrappers),  # DataParallel and FullyShardedDataParallel are nn.Modules
        schedule,
        loss_function(config, mesh, _last_layer(stages, schedule.num_stages)),
        mesh.group("pp"),
        backward_context=_no_sync_all(list(wrappers.values())),
    )
    return Engine(
        config,
        mesh,
        stages,
        {s: bounds[s] for s in mine},
        wrappers,
        optimizers,
        executor,
        _tied_group(config, mesh, schedule),
        pipeline_layers=bounds[-1].stop,
    )


def _last_layer(stages: Mapping[int, nn.Sequential], num_stages: int) -> nn.Module | None:
    """The model's last layer (the output head) where this rank holds the last stage, else None."""
    last = stages.get(num_stages - 1)
    return None if last is None else last[-1]


def _untie_across_stages(model: nn.Module, aliases: Mapping[str, str], stage_of: Mapping[int, int]) -> None:
    """A tied pair whose users fall in two stages of this rank (both wrapped, so both stepped) becomes
    two equal parameters, one per stage; :meth:`Engine._sum_tied_copies` keeps them equal. (A rank
    holding only the alias's layer already has its own copy: ``build_model`` drew it for that rank.)"""
    for alias, name in aliases.items():
        alias_stage, name_stage = stage_of.get(layer_of(alias)), stage_of.get(layer_of(name))
        if alias_stage is None or name_stage is None or alias_stage == name_stage:
            continue
        module_name, _, attr = alias.partition(".")[2].partition(".")[2].rpartition(".")
        # model.layers is the nn.ModuleDict build_engine made; torch types a module's attributes Tensor | Module.
        module = cast(nn.ModuleDict, model.layers)[str(layer_of(alias))].get_submodule(module_name)
        setattr(module, attr, nn.Parameter(getattr(module, attr).detach().clone()))


def _tied_group(config: Config, mesh: Mesh, schedule: Schedule) -> dist.ProcessGroup | None:
    """The group of pipeline ranks holding the first and the last stage (Megatron-LM's embedding group),
    when a tied weight lives on both and they are different ranks; created collectively on every rank."""
    if not tied_names(config.model) or config.parallel.pp == 1:
        return None
    ends = {schedule.rank_of(0), schedule.rank_of(schedule.num_stages - 1)}
    return mesh.group_at("pp", ends) if len(ends) > 1 else None
