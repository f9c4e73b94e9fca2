"""``polyshard inspect`` and ``polyshard export``: read checkpoints without starting any process."""

from __future__ import annotations

from pathlib import Path

import typer


def inspect(ckpt: Path = typer.Argument(..., exists=True, help="A checkpoint step folder or a run folder.")) -> None:
    """Print mesh, step, parameter names, global shapes and sizes; verify every checksum."""
    from polyshard.trainer.checkpoint import CheckpointError, find_checkpoint
    from polyshard.trainer.export import describe

    try:
        typer.echo(describe(find_checkpoint(ckpt)))
    except CheckpointError as err:
        typer.echo(f"checkpoint error: {err}", err=True)
        raise typer.Exit(2) from err


def export(
    ckpt: Path = typer.Argument(..., exists=True, help="A checkpoint step folder or a run folder."),
    out: Path = typer.Argument(..., help="The consolidated .safetensors file to write."),
) -> None:
    """Write one safetensors file the plain model loads with load_state_dict(strict=True)."""
    from polyshard.trainer.checkpoint import CheckpointError, find_checkpoint
    from polyshard.trainer.export import export as export_checkpoint

    try:
        typer.echo(f"wrote {export_checkpoint(find_checkpoint(ckpt), out)}")
    except CheckpointError as err:
        typer.echo(f"checkpoint error: {err}", err=True)
        raise typer.Exit(2) from err
