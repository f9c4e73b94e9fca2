"""``polyshard train``: validate a config, then launch the workers through torchrun."""

from __future__ import annotations

from pathlib import Path

import typer

from polyshard.cli.launch import run_local


def train(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="A TOML config (see apps/configs/)."),
    nproc: int | None = typer.Option(None, "--nproc", help="Local processes (default: the mesh size in the config)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set training.lr=3e-4 (repeatable)."),
    out: Path | None = typer.Option(None, "--out", help="Run folder (default: runs/<config name>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest complete checkpoint in --out."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the mesh, groups and memory per rank; start nothing."),
) -> None:
    """Train a model on an N-D mesh of local processes."""
    from polyshard.trainer.config import load_config
    from polyshard.trainer.constraints import validate
    from polyshard.trainer.errors import ConfigError
    from polyshard.trainer.plan import describe

    try:
        parsed = load_config(config, overrides)
        world = nproc if nproc is not None else parsed.parallel.world_size
        validate(parsed, world_size=world)
    except ConfigError as err:  # before any process starts
        typer.echo(f"config error: {err}", err=True)
        raise typer.Exit(2) from err
    if dry_run:
        typer.echo(describe(parsed))
        return
    out = out or Path("runs") / config.stem
    args = ["--config", str(config.resolve()), "--out", str(out.resolve())]
    for item in overrides:
        args += ["--set", item]
    if resume:
        args.append("--resume")
    raise typer.Exit(run_local(world, "polyshard.trainer.run", args))
