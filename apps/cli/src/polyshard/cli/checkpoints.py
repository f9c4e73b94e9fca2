"""``polyshard inspect`` and ``polyshard export``: read checkpoints without starting any process."""

from __future__ import annotations

from pathlib import Path

import typer


def _resolve(path: Path) -> Path:
    """A step folder, or the newest complete one under a run folder or its checkpoints/ folder."""
    from polyshard.trainer.checkpoint import latest_checkpoint

    if (path / "index.json").exists():
        return path
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found is not None:
            return found
    raise typer.BadParameter(f"{path} holds no complete checkpoint (no index.json)", param_hint="CKPT")


def inspect(ckpt: Path = typer.Argument(..., exists=True, help="A checkpoint step folder or a run folder.")) -> None:
    """Print mesh, step, parameter names, global shapes and sizes; verify every checksum."""
    from polyshard.trainer.checkpoint import CheckpointError
    from polyshard.trainer.export import describe

    try:
        typer.echo(describe(_resolve(ckpt)))
    except CheckpointError as err:
        typer.echo(f"checkpoint error: {err}", err=True)
        raise typer.Exit(2) from err


def export(
    ckpt: Path = typer.Argument(..., exists=True, help="A checkpoint step folder or a run folder."),
    out: Path = typer.Argument(..., help="The consolidated .safetensors file to write."),
) -> None:
    """Write one safetensors file the plain model loads with load_state_dict(strict=True)."""
    from polyshard.trainer.checkpoint import CheckpointError
    from polyshard.trainer.export import export as export_checkpoint

    try:
        typer.echo(f"wrote {export_checkpoint(_resolve(ckpt), out)}")
    except CheckpointError as err:
        typer.echo(f"checkpoint error: {err}", err=True)
        raise typer.Exit(2) from err
