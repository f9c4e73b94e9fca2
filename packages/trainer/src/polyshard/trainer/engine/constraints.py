"""Checks between config fields, run before any process starts.

Each check raises :class:`ConfigError` saying what is wrong and what would
work, e.g. ``parallel.tp=4 does not divide model.num_heads=6; choose tp in
[1, 2, 3, 6]``.
"""

from __future__ import annotations

import shutil

import torch
from torch._dynamo.eval_frame import is_dynamo_supported

from polyshard.checkpoint import CheckpointError
from polyshard.mesh import divisors
from polyshard.models import check_model, sequence_length, spec_of
from polyshard.models.hf_adapters import hf_adapter_of
from polyshard.tp import replicates_kv, valid_tp_sizes
from polyshard.trainer import extras
from polyshard.trainer.config import Config
from polyshard.trainer.config.rules import check_sections
from polyshard.trainer.engine.lora import check_lora
from polyshard.trainer.errors import ConfigError
from polyshard.trainer.tasks import task_for, task_of


def validate(config: Config, world_size: int | None = None) -> None:
    """Raise :class:`ConfigError` for the first constraint ``config`` breaks."""
    model, par, train = config.model, config.parallel, config.training
    check_sections(config)  # the rules between settings that need no processes (also run by from_dict)
    check_model(model)  # the family's own constraints between [model] fields
    if world_size is not None and par.world_size != world_size:
        raise ConfigError(
            f"the mesh dp={par.dp} x ep={par.ep} x cp={par.cp} x pp={par.pp} x tp={par.tp} has {par.world_size} ranks "
            f"but {world_size} processes were asked for; use --nproc {par.world_size} or change the mesh"
        )
    _check_tensor_parallel(config)
    _check_pipeline(config)
    _check_experts(config)
    _check_context(config)
    _check_logging(config)
    _check_hf_checkpoints(config)
    _check_documents(config)
    _check_compile(config)
    _check_loss_chunks(config)
    spec = spec_of(model)
    spec.check(config.model, config.parallel)  # the family's own constraints
    check_lora(config)  # [lora]'s targets exist, its rank fits them, its PEFT folder is this model's
    task_for(config).check_config(config)
    data_ranks = par.data_ranks
    per_step = data_ranks * par.microbatches
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size={train.global_batch_size} does not split over "
            f"dp x ep = {data_ranks} data ranks x {par.microbatches} microbatches; "
            f"use a multiple of {per_step}"
        )


def _check_loss_chunks(config: Config) -> None:
    """training.loss_chunks projects a language model's hidden states inside the loss, with the head's
    weight (under ZeRO-3 the head stays gathered from its forward through its backward for it)."""
    chunks = config.training.loss_chunks
    if chunks <= 1:
        return
    if not task_of(config.model).generates_text:
        raise ConfigError(
            f"training.loss_chunks={chunks} chunks a language model's head and loss; model.kind="
            f"{config.model.kind!r} classifies, set loss_chunks = 0"
        )
    # Each chunk is a slice of the tokens one rank's microbatch holds: more chunks than tokens are empty
    # slices that still cost a view and a checkpointed call each (1e9 of them grew a worker past 3.8 GB).
    par = config.parallel
    rows = max(1, config.training.global_batch_size // (par.data_ranks * par.microbatches))
    positions = max(1, sequence_length(config.model) // par.cp)
    if chunks > rows * positions:
        cp = f" / cp={par.cp}" if par.cp > 1 else ""
        raise ConfigError(
            f"training.loss_chunks={chunks} is more than the {rows * positions:,} tokens a rank's microbatch holds "
            f"({rows} rows of global_batch_size / (dp x ep x microbatches) x {positions} positions, "
            f"model.context_length{cp}); choose loss_chunks in 0..{rows * positions}"
        )


def layout_notes(config: Config) -> list[str]:
    """What the layout does that the user may not expect (printed at launch and by --dry-run)."""
    model, tp = config.model, config.parallel.tp
    notes = []
    if replicates_kv(model.kv_heads, tp):
        notes.append(
            f"tp={tp} is more than model.num_kv_heads={model.kv_heads}: each key/value head is computed on "
            f"{tp // model.kv_heads} tp ranks (its weights replicated, their gradients summed over tp)"
        )
    return notes


def _check_tensor_parallel(config: Config) -> None:
    model, tp = config.model, config.parallel.tp
    valid = valid_tp_sizes(model.num_heads, model.kv_heads, replicate_kv=True)
    if model.num_heads % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide model.num_heads={model.num_heads}; choose tp in {valid}")
    if model.kv_heads % tp and tp % model.kv_heads:
        raise ConfigError(
            f"parallel.tp={tp} neither divides model.num_kv_heads={model.kv_heads} nor is a multiple of it "
            f"(which replicates each kv head); choose tp in {valid}"
        )
    if config.parallel.sequence_parallel and sequence_length(model) % tp:
        # Offer only sizes that also pass the head and MLP checks above.
        widths = (model.kv_heads, model.mlp_width)
        valid = [d for d in divisors(sequence_length(model)) if all(w % d == 0 for w in widths)]
        raise ConfigError(
            f"sequence parallelism splits the {sequence_length(model)} positions over tp={tp}; "
            f"choose tp in {valid} or turn parallel.sequence_parallel off"
        )


def _check_pipeline(config: Config) -> None:
    model, par = config.model, config.parallel
    stages = par.pp * par.virtual_stages
    # The embedding and the head are pipeline layers too: num_layers blocks + 2.
    layers = model.num_layers + 2
    if stages > layers:
        raise ConfigError(
            f"pp={par.pp} x virtual_stages={par.virtual_stages} = {stages} pipeline stages but the model has only "
            f"{layers} layers (embedding, {model.num_layers} blocks, head); use at most {layers} stages"
        )
    if par.stage_layers is not None and (len(par.stage_layers) != stages or sum(par.stage_layers) != layers):
        raise ConfigError(
            f"parallel.stage_layers={par.stage_layers} must give {stages} pipeline stages (pp x virtual_stages) "
            f"layer counts that add up to {layers} (embedding, {model.num_layers} blocks, head)"
        )
    if par.schedule == "interleaved" and par.microbatches % par.pp:
        raise ConfigError(
            f"the interleaved schedule needs parallel.microbatches ({par.microbatches}) to be a multiple of "
            f"parallel.pp ({par.pp}); try microbatches={par.pp * max(1, par.microbatches // par.pp)}"
        )
    if par.schedule == "dualpipev" and par.microbatches < 2 * par.pp:
        raise ConfigError(
            f"the dualpipev schedule needs parallel.microbatches ({par.microbatches}) >= 2 x parallel.pp "
            f"({2 * par.pp}) to fill its V; try microbatches={2 * par.pp}"
        )


def _check_context(config: Config) -> None:
    model, par = config.model, config.parallel
    if par.cp == 1:
        return
    if not spec_of(model).context_parallel:
        raise ConfigError(
            f"parallel.cp={par.cp} is not supported for model.kind={model.kind!r} yet (its tokens are not one "
            "causal sequence polyshard.cp can split); use cp=1"
        )
    chunks = 2 * par.cp
    if sequence_length(model) % chunks:
        fits = divisors(sequence_length(model) // 2)  # cp divides S/2: S splits into 2 x cp chunks
        raise ConfigError(
            f"context parallelism cuts each sequence into 2 x cp = {chunks} chunks (two per rank, load-balanced); "
            f"model.context_length={sequence_length(model)} does not split into them; choose cp in {fits}"
        )
    if model.dropout > 0:
        raise ConfigError(
            f"model.dropout={model.dropout} with parallel.cp={par.cp}: the context-parallel attention kernel has no "
            "attention dropout; set model.dropout=0"
        )
    if par.sequence_parallel and (sequence_length(model) // par.cp) % par.tp:
        raise ConfigError(
            f"sequence parallelism splits each cp rank's {sequence_length(model) // par.cp} positions over "
            f"tp={par.tp}; choose another tp or cp, or turn parallel.sequence_parallel off"
        )
    _check_ulysses_heads(config)


def _check_ulysses_heads(config: Config) -> None:
    """Ulysses splits each tp rank's heads over its all-to-all group: the query heads must divide by it,
    the kv heads divide by it or it by them (then each is repeated, as tp replicates them)."""
    model, par = config.model, config.parallel
    if par.cp_style not in ("ulysses", "ulysses+ring"):
        return
    ulysses = par.cp if par.cp_style == "ulysses" else (par.cp_ulysses or 1)
    heads, kv = model.num_heads // par.tp, max(1, model.kv_heads // par.tp)  # after tp (kv replicated past tp)
    valid = [d for d in divisors(heads) if kv % d == 0 or d % kv == 0]
    if heads % ulysses == 0 and (kv % ulysses == 0 or ulysses % kv == 0):
        return
    what = f"cp={par.cp}" if par.cp_style == "ulysses" else f"cp_ulysses={par.cp_ulysses}"
    two_d = [d for d in valid if d > 1 and par.cp % d == 0 and d < par.cp]
    other = f", or cp_style 'ulysses+ring' with cp_ulysses in {two_d}" if two_d else ""
    raise ConfigError(
        f"parallel.{what} with cp_style {par.cp_style!r} splits each tp rank's {heads} query and {kv} key/value "
        f"heads (model.num_heads={model.num_heads}, num_kv_heads={model.kv_heads}, tp={par.tp}) over {ulysses} "
        f"ranks; the all-to-all group's size must be in {valid}{other}, or use cp_style 'ring'"
    )


def _check_documents(config: Config) -> None:
    """Document masking needs a causal language model: its rows are packed documents of tokens."""
    task = task_of(config.model)
    if config.data.document_mask and task.input_segments is None:
        raise ConfigError(
            f"data.document_mask = true applies to language models, whose rows pack documents of tokens; "
            f"model.kind={config.model.kind!r} trains on {task.name} (no documents to mask); "
            "set data.document_mask = false"
        )
    if config.data.document_mask and config.model.dropout:
        # The masked cores (block-sparse, FlexAttention) have no attention-probability dropout.
        raise ConfigError(
            f"model.dropout={config.model.dropout} runs only on plain causal attention, not with "
            "data.document_mask = true; set model.dropout = 0 or turn document masking off"
        )


def _check_experts(config: Config) -> None:
    if config.parallel.ep > 1 and not spec_of(config.model).has_experts:
        raise ConfigError(
            f"parallel.ep={config.parallel.ep} needs experts; set model.kind='moe-gpt' (a family with experts) or ep=1"
        )


def _check_hf_checkpoints(config: Config) -> None:
    every, hf_every = config.checkpoint.every, config.checkpoint.hf_every
    if not hf_every:
        return
    if every and hf_every % every:
        raise ConfigError(
            f"checkpoint.hf_every={hf_every} must be a multiple of checkpoint.every={every}: the Hugging Face "
            f"folder is written from the checkpoint of the same step; e.g. hf_every={every * -(-hf_every // every)}"
        )
    try:
        hf_adapter_of(config.model)
    except CheckpointError as err:
        raise ConfigError(f"checkpoint.hf_every={hf_every}: {err}") from err


def _check_logging(config: Config) -> None:
    logging, steps = config.logging, config.training.steps
    if logging.profile_steps is not None and logging.profile_steps[1] > steps:
        first = min(logging.profile_steps[0], steps)
        raise ConfigError(
            f"logging.profile_steps={logging.profile_steps} ends past training.steps={steps}; give steps within "
            f"1..{steps}, e.g. [{first}, {steps}]"
        )
    if logging.tensorboard:
        extras.tensorboard()
    if logging.wandb:
        extras.wandb()


def _check_compile(config: Config) -> None:
    """``training.compile`` needs dynamo on this Python and, for inductor's CPU code, a C++ compiler."""
    if not config.training.compile:
        return
    if not is_dynamo_supported():
        raise ConfigError(
            "training.compile = true, but torch.compile does not support this Python/torch build; "
            "set training.compile = false (or drop --compile)"
        )
    if not torch.cuda.is_available() and not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        raise ConfigError(
            "training.compile = true on CPU needs a C++ compiler (inductor builds its kernels with one) and "
            "none of g++, c++, clang++ is on PATH; install one (apt-get install g++) or set training.compile = false"
        )
