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
import datetime
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from polyshard.cp import position_ids, ulysses_ring_groups
from polyshard.dp import (
    DataParallel,
    DataParallelWrapper,
    FullyShardedDataParallel,
    MixedPrecision,
    ParamSet,
)
from polyshard.ep import apply_expert_parallel, expert_parameters, share_routing_statistics
from polyshard.mesh import Mesh, TensorPlacement, get_placement, set_placement
from polyshard.models import build_model, layer_of, sequence_length, spec_of, tied_names
from polyshard.models.anatomy import has_moe, moe_layers
from polyshard.pp import PipelineExecutor, Schedule, Stage, make_schedule
from polyshard.tp import mark_sequence_parallel
from polyshard.tp import (
    parallelize as tp_parallelize,
)
from polyshard.trainer.config import Config
from polyshard.trainer.config.sections import SPLIT_BACKWARD
from polyshard.trainer.engine.compiling import compile_blocks
from polyshard.trainer.engine.context import apply_context_parallel
from polyshard.trainer.engine.engine import Engine
from polyshard.trainer.engine.frozen_dtype import keep_frozen_in_dtype
from polyshard.trainer.engine.layout import global_names, pipeline_bounds, tp_plan
from polyshard.trainer.engine.lora import apply_lora
from polyshard.trainer.engine.optimizer import build_optimizer
from polyshard.trainer.tasks import LossFn, task_for
from polyshard.trainer.tasks.loss import TokenMeanLoss


def loss_function(config: Config, mesh: Mesh, head: nn.Module | None = None) -> LossFn:
    """The last stage's loss, as the model's task defines it (vocabulary-parallel under tp). ``head``: the
    model's last layer where this rank holds it (a chunked loss projects with its weight)."""
    return task_for(config).loss(config, mesh.group("tp") if config.parallel.tp > 1 else None, head)


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


def _wrap_data_parallel(
    stage: nn.Sequential, config: Config, mesh: Mesh, head: nn.Module | None = None
) -> DataParallelWrapper:
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
            # The output head stays gathered from its forward until its gradients are reduced (FSDP2's
            # reshard_after_forward=False for the last layers, torchtitan's default): its backward starts
            # right after, and the chunked loss multiplies by its weight after its forward and in backward.
            keep_gathered=[head] if head is not None else [],
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


def build_engine(config: Config, mesh: Mesh, device: torch.device | str = "cpu") -> Engine:
    """Build this rank's pipeline layers and apply TP -> EP -> PP -> DP/ZeRO to them.

    Only this rank's layers are materialised; each is seeded by its global
    index (see :mod:`polyshard.models`), so every layout starts from the
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
        mtp_loss_weight=config.training.mtp_loss_weight,
    )
    model = nn.Module()  # this rank's layers under their global names: layers.<i>.…
    # A family's model keeps its pipeline layers in an nn.ModuleList (models.spec); torch types it Tensor | Module.
    model.layers = nn.ModuleDict({str(i): cast(nn.ModuleList, full.layers)[i] for i in owned})
    del full, skeleton
    if par.cp > 1:
        ulysses_groups = None
        if par.cp_style == "ulysses+ring" and par.cp_ulysses is not None:  # collective: every rank, same order
            timeout = datetime.timedelta(seconds=par.timeout_s)
            ulysses_groups = ulysses_ring_groups(mesh.layout.groups("cp"), par.cp_ulysses, timeout=timeout)
        apply_context_parallel(model, mesh.group("cp"), par.cp_style, ulysses_groups=ulysses_groups)
    aliases = tied_names(config.model)
    _untie_across_stages(model, aliases, {i: s for s in mine for i in bounds[s]})
    if par.tp > 1:
        tp_parallelize(model, tp_group=mesh.group("tp"), plan=tp_plan(config, owned))
    if has_moe(model):
        apply_expert_parallel(model, group=mesh.group("ep"))
        positions = None
        if par.cp > 1:  # each cp rank routes its chunks; aux losses and capacity are the whole sequences'
            positions = position_ids(sequence_length(config.model), mesh.group("cp"), device)
            share_routing_statistics(model, group=mesh.group("cp"), positions=positions)
        if par.tp > 1 and par.sequence_parallel:
            _route_sequence_shards(model, config, mesh, positions, device)
    # After tp converted the linears (adapters split like their base) and ep replaced the experts' weights
    # (which must stay frozen too): adapters on, the rest frozen.
    apply_lora(model, config)
    keep_frozen_in_dtype(model, config)  # model.frozen_dtype: before dp, so ZeRO-3 shards the base in it
    stages = {s: Stage(*(model.layers[str(i)] for i in bounds[s])) for s in mine}
    for s, stage in stages.items():
        _name_records_globally(stage, bounds[s], aliases)
    head = _last_layer(stages, schedule.num_stages)
    wrappers = {
        s: _wrap_data_parallel(stage, config, mesh, head if any(m is head for m in stage) else None)
        for s, stage in stages.items()
    }
    if config.training.compile:
        # After every strategy has replaced its modules and set its hooks: only block forwards compile.
        compile_blocks(stages.values(), retain_graph=par.schedule in SPLIT_BACKWARD)
    optimizers = [
        build_optimizer(w, config, global_names(stages[s], bounds[s], aliases), mesh) for s, w in wrappers.items()
    ]
    executor = PipelineExecutor(
        cast(Mapping[int, nn.Module], wrappers),  # DataParallel and FullyShardedDataParallel are nn.Modules
        schedule,
        loss_function(config, mesh, head),
        mesh.group("pp"),
        backward_context=_no_sync_all(list(wrappers.values())),
    )
    # Multi-token prediction: one loss per depth (each divides by its own count of targets), as the main one.
    depths = config.model.prediction_depth
    mtp_loss_fns = [cast(TokenMeanLoss, loss_function(config, mesh, head)) for _ in range(depths)]
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
        mtp_loss_fns=mtp_loss_fns,
    )


def _in_prediction_depth(name: str) -> bool:
    """A module of a multi-token prediction depth (``layers.<i>.mtp.depths.<k>...``): the depths run on
    whole sequences, with no sequence parallelism inside."""
    return ".mtp." in f".{name}."


def _route_sequence_shards(
    model: nn.Module, config: Config, mesh: Mesh, cp_positions: torch.Tensor | None, device: torch.device | str
) -> None:
    """Sequence parallelism with experts: each tp rank routes the sequence shard it holds at the MLP and
    exchanges it over its ep group (the ranks with its tp coordinate), so the router and the experts,
    replicated over tp, see different tokens on each tp rank. Their gradients are summed over tp, as a
    sequence-parallel norm's are (flagged alike); the aux losses and the capacity rule are the whole
    sequences' (the token group spans tp, and cp when there is one). The prediction depths' MoE
    blocks run on whole sequences and keep their tp-replicated routing."""
    par = config.parallel
    length = sequence_length(config.model)
    whole = torch.arange(length, device=device) if cp_positions is None else cp_positions  # this cp rank's
    shard = whole.numel() // par.tp
    positions = whole[mesh.coord("tp") * shard : (mesh.coord("tp") + 1) * shard]  # split_sequence's piece
    group = mesh.group(("cp", "tp")) if par.cp > 1 else mesh.group("tp")
    share_routing_statistics(model, group=group, positions=positions, loss_sharers=par.tp, skip=_in_prediction_depth)
    for name, layer in moe_layers(model):
        if not _in_prediction_depth(name):
            for param in layer.parameters():  # after ep, which replaced the expert parameters
                mark_sequence_parallel(param)


def _last_layer(stages: Mapping[int, nn.Sequential], num_stages: int) -> nn.Module | None:
    """The model's last layer (the output head) where this rank holds the last stage, else None."""
    last = stages.get(num_stages - 1)
    return None if last is None else last[-1]


def _untie_across_stages(model: nn.Module, aliases: Mapping[str, str], stage_of: Mapping[int, int]) -> None:
    """A tied pair whose users fall in two stages of this rank (both wrapped, so both stepped) becomes
    two equal parameters, one per stage; :meth:`Engine._sum_tied_copies` keeps them equal. (A rank
    holding only the alias's layer already has its own copy: ``build_model`` drew it for that rank.)
    Two aliases of one weight in one stage (a tied head and multi-token prediction's embedding) share
    that stage's one copy, as they share the weight on one process."""
    copies: dict[tuple[int, str], nn.Parameter] = {}
    for alias, name in aliases.items():
        alias_stage, name_stage = stage_of.get(layer_of(alias)), stage_of.get(layer_of(name))
        if alias_stage is None or name_stage is None or alias_stage == name_stage:
            continue
        module_name, _, attr = alias.partition(".")[2].partition(".")[2].rpartition(".")
        # model.layers is the nn.ModuleDict build_engine made; torch types a module's attributes Tensor | Module.
        module = cast(nn.ModuleDict, model.layers)[str(layer_of(alias))].get_submodule(module_name)
        key = (alias_stage, name)
        if key not in copies:
            copies[key] = nn.Parameter(getattr(module, attr).detach().clone())
        setattr(module, attr, copies[key])


def _tied_group(config: Config, mesh: Mesh, schedule: Schedule) -> dist.ProcessGroup | None:
    """The group of pipeline ranks holding the first and the last stage (Megatron-LM's embedding group),
    when a tied weight lives on both and they are different ranks; created collectively on every rank."""
    if not tied_names(config.model) or config.parallel.pp == 1:
        return None
    ends = {schedule.rank_of(0), schedule.rank_of(schedule.num_stages - 1)}
    return mesh.group_at("pp", ends) if len(ends) > 1 else None
