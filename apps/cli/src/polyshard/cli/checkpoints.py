"""``polyshard inspect`` and ``polyshard export``: read checkpoints without starting any process."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from polyshard.cli.errors import fail
from polyshard.cli.families import HF_FAMILIES

if TYPE_CHECKING:
    from polyshard.trainer import Config


def inspect(ckpt: Path = typer.Argument(..., exists=True, help="A checkpoint step folder or a run folder.")) -> None:
    """Print mesh, step, parameter names, global shapes and sizes; verify every checksum."""
    from polyshard.checkpoint import CheckpointError, describe, open_checkpoint

    try:
        typer.echo(describe(open_checkpoint(ckpt, _report_skip)))
    except CheckpointError as err:
        fail("checkpoint", err)


def export(
    ckpt: Path = typer.Argument(..., exists=True, help="A checkpoint step folder or a run folder."),
    out: Path = typer.Argument(..., help="The .safetensors file to write (--format hf or peft: the new folder)."),
    format: str = typer.Option(
        "polyshard",
        "--format",
        help="polyshard: one file of the plain model's weights (polyshard.models.load builds the model for it); "
        f"hf: a transformers folder ({HF_FAMILIES}); peft: the run's LoRA adapters as a PEFT folder.",
    ),
    max_shard_mb: float = typer.Option(
        5120.0, "--max-shard-mb", min=1.0, help="--format hf: weights above this many MiB go into several files."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace a file (--format hf or peft: folder) already at OUT."
    ),
    merge: bool = typer.Option(
        False, "--merge", help="--format hf of a LoRA run: fold the adapters into their linears (W + scale B A)."
    ),
) -> None:
    """Write the unsharded model: one safetensors file the plain model loads with load_state_dict(strict=True),
    or (--format hf) a folder transformers' AutoModelForCausalLM.from_pretrained loads."""
    from polyshard.checkpoint import TOKENIZER, CheckpointError, open_checkpoint
    from polyshard.checkpoint.hf import check_new_folder
    from polyshard.checkpoint.output import reading
    from polyshard.trainer import export as export_checkpoint
    from polyshard.trainer import export_note, saved_config, write_hf
    from polyshard.trainer.checkpointing.peft import merged_weights, write_peft

    if format not in ("polyshard", "hf", "peft"):
        raise typer.BadParameter(f"{format!r}: choose polyshard, hf or peft", param_hint="--format")
    if merge and format != "hf":
        raise typer.BadParameter("--merge goes with --format hf (a merged Hugging Face model)", param_hint="--merge")
    try:
        source = open_checkpoint(ckpt, _report_skip)
        if format == "peft":
            written = write_peft(source, out, overwrite=overwrite)
        elif format == "hf":
            tokenizer = source.asset(TOKENIZER)  # the run's tokenizer goes with the weights
            config = saved_config(source)
            if config.lora is not None and not merge:
                raise CheckpointError(
                    f"{source.folder} trained LoRA adapters beside a frozen model: --format peft writes the "
                    "adapters, --format hf --merge the model with them folded in"
                )
            if merge:  # the folder is checked before the weights are merged in memory
                check_new_folder(out, overwrite=overwrite, protected=reading(source.folder))
            weights = merged_weights(source) if merge else source  # else streamed, one tensor at a time
            written = write_hf(weights, config.model, out, int(max_shard_mb * 2**20), tokenizer, overwrite=overwrite)
            note = export_note(config.model)
            if note:
                typer.echo(f"note: {note}")
        else:
            if saved_config(source).lora is not None:  # the plain model has no place for the adapters
                raise CheckpointError(
                    f"{source.folder} trained LoRA adapters beside a frozen model: --format peft writes the "
                    "adapters, --format hf --merge the model with them folded in"
                )
            written = export_checkpoint(source, out, overwrite=overwrite)
        typer.echo(f"wrote {written}")
    except (CheckpointError, OSError) as err:  # OSError: a full disk or a folder that turned read-only
        fail("checkpoint", err)


def generate(
    ckpt: Path = typer.Argument(..., exists=True, help="A checkpoint step folder or a run folder (any mesh)."),
    prompt: str = typer.Option("ROMEO:", "--prompt", help="Text to continue."),
    tokens: int = typer.Option(200, "--tokens", min=1, help="New tokens to sample."),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="Softmax temperature (0: greedy)."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Sample among the k likeliest tokens (0: all)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the sampling generator."),
) -> None:
    """Sample text from a GPT checkpoint: its shards are gathered on one process, as export does."""
    import math

    from polyshard.checkpoint import TOKENIZER, CheckpointError, open_checkpoint
    from polyshard.trainer import DataError, consolidate, load_tokenizer, sample_text, saved_config
    from polyshard.trainer.tasks import task_of

    if not math.isfinite(temperature):
        raise typer.BadParameter("give a finite temperature", param_hint="--temperature")
    if not prompt:
        raise typer.BadParameter("give some text to continue", param_hint="--prompt")
    try:
        source = open_checkpoint(ckpt, _report_skip)
        config = saved_config(source)
        if not task_of(config.model).generates_text:
            kind = config.model.kind
            raise CheckpointError(f"{source.folder} holds a {kind!r} model, which makes no text; generate needs a GPT")
        saved = source.asset(TOKENIZER)  # the run's own tokenizer, saved with its checkpoints
        tokenizer = load_tokenizer(str(saved) if saved else config.data.tokenizer)
        state = consolidate(source)
        text = sample_text(
            config, state, tokens, prompt, temperature=temperature, top_k=top_k, seed=seed, tokenizer=tokenizer
        )
    except (CheckpointError, DataError) as err:
        fail("data" if isinstance(err, DataError) else "checkpoint", err)
    typer.echo(text)


def _report_skip(folder: Path, err: Exception) -> None:
    typer.echo(f"skipping {folder}: {err}", err=True)


def parse_mesh(text: str) -> dict[str, int]:
    """'dp=1,tp=4,pp=2' -> {'dp': 1, 'tp': 4, 'pp': 2} (axes left out are 1)."""
    from polyshard.trainer import MESH_AXES

    mesh: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        axis, _, size = item.partition("=")
        if axis not in MESH_AXES or not size.isdigit() or int(size) < 1:
            raise typer.BadParameter(
                f"{item!r}: write axis=size with axes {', '.join(MESH_AXES)}, e.g. --mesh dp=1,tp=4,pp=2",
                param_hint="--mesh",
            )
        mesh[axis] = int(size)
    return mesh


def reshard(
    src: Path = typer.Argument(..., exists=True, help="A checkpoint step folder or a run folder."),
    dst: Path = typer.Argument(..., help="Folder to write step_<N>/ into, e.g. runs/<new run>/checkpoints."),
    mesh: str = typer.Option(..., "--mesh", help="Target mesh, e.g. dp=1,tp=4,pp=2[,ep=2]; axes left out are 1."),
    zero_stage: int | None = typer.Option(None, "--zero-stage", help="Target ZeRO stage (default: the source's)."),
    stage_layers: str | None = typer.Option(
        None, "--stage-layers", help="Pipeline layers per stage, e.g. 3,2,2,1 (default: balanced by size)."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Other parallel settings of the target, e.g. --set parallel.microbatches=4 (repeatable)."
    ),
    max_block_mb: float = typer.Option(64.0, "--max-block-mb", help="Most tensor data held at once (MiB, about)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a DST/step_<N> folder already there."),
) -> None:
    """Lay a checkpoint out for another mesh: tp, pp, ep, dp and ZeRO all change; no process starts."""
    from polyshard.checkpoint import CheckpointError, open_checkpoint
    from polyshard.mesh import MeshError, PlacementError
    from polyshard.trainer import ConfigError, apply_overrides, saved_config, target_config
    from polyshard.trainer import reshard as reshard_checkpoint

    parallel: dict[str, object] = {}
    if zero_stage is not None:
        parallel["zero_stage"] = zero_stage
    if stage_layers is not None:
        try:
            parallel["stage_layers"] = [int(n) for n in stage_layers.split(",")]
        except ValueError as err:
            raise typer.BadParameter("give layer counts like 3,2,2,1", param_hint="--stage-layers") from err
    try:
        extra = apply_overrides({}, overrides)
        if set(extra) - {"parallel"}:
            raise ConfigError("reshard changes only the layout: --set takes parallel.<key>=<value> only")
        parallel.update(extra.get("parallel", {}))
        source = open_checkpoint(src, _report_skip)
        config = target_config(source, parse_mesh(mesh), parallel)
        # The Checkpoint verified every file's sha256 once; reshard reads through it.
        report = reshard_checkpoint(source, dst, config, max_block_bytes=int(max_block_mb * 2**20), overwrite=overwrite)
    except (ConfigError, CheckpointError, MeshError, PlacementError, OSError) as err:
        fail("reshard", err)
    typer.echo(str(report))
    changed = " ".join(f"--set parallel.{k}={_toml(v)}" for k, v in _changes(saved_config(source), config).items())
    run = dst.parent if dst.name == "checkpoints" else dst
    typer.echo(f"continue with: polyshard train CONFIG {changed} --out {run} --resume")


def _changes(before: Config, after: Config) -> dict[str, object]:
    """Parallel settings that differ between two configs."""
    import dataclasses

    old, new = dataclasses.asdict(before.parallel), dataclasses.asdict(after.parallel)
    for fields in (old, new):  # no dp_shard is dp_shard = dp (ZeRO over all of dp), which --set can write
        fields["dp_shard"] = fields["dp_shard"] or fields["dp"]
    return {k: v for k, v in new.items() if old[k] != v}


def _toml(value: object) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)
