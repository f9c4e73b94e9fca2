"""``polyshard train``: validate a config, then launch the workers through torchrun."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from polyshard.trainer import PlannedStep

from polyshard.cli.errors import fail
from polyshard.cli.families import HF_FAMILIES
from polyshard.cli.launch import run_local
from polyshard.cli.train_interrupted import interrupted_line


def train(
    context: typer.Context,
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="A TOML config (see apps/configs/)."),
    nproc: int | None = typer.Option(None, "--nproc", help="Local processes (default: the mesh size in the config)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set optimizer.lr=3e-4 (repeatable)."),
    out: Path | None = typer.Option(None, "--out", help="Run folder (default: runs/<config name>)."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the latest complete checkpoint in --out (saved on any mesh)."
    ),
    init_from: str | None = typer.Option(
        None,
        "--init-from",
        help=f"Start from this checkpoint (any mesh), or from a Hugging Face model ({HF_FAMILIES}): a folder as "
        "hf:DIR, or a model id in the local Hugging Face cache as hf:org/name; the new run goes to --out.",
    ),
    stop_at: int | None = typer.Option(
        None,
        "--stop-at",
        help="End at this step with a checkpoint, keeping the schedule of training.steps (a preemption window); "
        "--resume later continues exactly as an uninterrupted run.",
    ),
    compiled: bool = typer.Option(
        False,
        "--compile",
        help="torch.compile each transformer block (sets training.compile = true); the first steps pay the "
        "compile time, metrics.jsonl records compiles and recompiles.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the mesh, groups and memory per rank; start nothing."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Start a new run in an --out that holds another run's checkpoints (replaced)."
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Launch even when the planner's memory estimate is larger than this machine's memory, or there are "
        "more processes than its cores and memory hold.",
    ),
    layout: str = typer.Option(
        "manual",
        "--layout",
        help="auto: the layout planner chooses dp, tp, pp, ep, cp, ZeRO, microbatches and schedule for --nproc "
        "processes, and the run logs its prediction against what it measures; manual: the axes the config gives.",
    ),
    profile: str | None = typer.Option(
        None,
        "--profile",
        help="With --layout auto: the machine profile (default: this machine's, from `polyshard plan --calibrate`).",
    ),
    torchrun: list[str] = typer.Option(
        [],
        "--torchrun",
        help="Pass an option to torchrun for multi-node jobs, e.g. --torchrun=--nnodes=2 "
        "--torchrun=--node-rank=0 --torchrun=--rdzv-endpoint=host:29500 (--nproc is then per node).",
    ),
) -> None:
    """Train a model on an N-D mesh of processes (local by default, many nodes through torchrun's options)."""
    from polyshard.planner.fits import check_processes
    from polyshard.trainer import CheckpointError, ConfigError, DataError, prepare_launch, read_settings

    if layout not in ("manual", "auto"):
        raise typer.BadParameter(f"{layout!r}: choose manual or auto", param_hint="--layout")
    if stop_at is not None:
        overrides = [*overrides, f"training.stop_at={stop_at}"]
    if compiled:
        overrides = [*overrides, "training.compile=true"]
    out = out or Path("runs") / config.stem
    try:
        nodes = _nodes(torchrun)
        settings = read_settings(config, overrides)  # the file and --set, read once
        if nproc is not None and not (force or dry_run):  # before the planner lays out that many processes
            check_processes(nproc)
        prediction = None
        if layout == "auto":
            settings, prediction = _planned(settings, nproc, nodes, profile)
        launch = prepare_launch(
            settings,
            out=out,
            nproc=nproc,
            nodes=nodes,
            resume=resume,
            init_from=init_from,
            prediction=prediction,
            overwrite=overwrite or dry_run,  # a dry run writes nothing
        )
        too_big = None if force else _memory_refusal(launch.config, launch.nproc, dry_run)
    except (ConfigError, CheckpointError, DataError, ValueError) as err:  # before any process starts
        fail({ConfigError: "config", CheckpointError: "checkpoint", DataError: "data"}.get(type(err), "input"), err)
    for note in launch.notes:
        typer.echo(f"note: {note}")
    if dry_run:
        from polyshard.planner.dry_run import describe

        typer.echo(describe(launch.config))
        if too_big is not None:  # a plan for a larger machine is what --dry-run is for: said, not refused
            typer.echo(f"note: not on this machine: {too_big}")
        return
    launch.write()  # the resolved config (and the planner's prediction) every worker reads
    stopped = partial(interrupted_line, context, out)  # after Ctrl-C: the options again, to continue
    raise typer.Exit(run_local(launch.nproc, WORKER, launch.worker_args(), torchrun, interrupted=stopped))


WORKER = "polyshard.trainer.runtime.worker"


def _memory_refusal(config: Any, nproc: int, dry_run: bool) -> str | None:
    """The planner's estimate and the process count against this machine's memory and cores: a launch that
    cannot fit is refused (a ConfigError naming the estimate and the fix); a dry run is refused only past any
    machine's memory, and otherwise gets the reason back, to print under its plan."""
    from polyshard.planner.fits import check_fits, check_processes
    from polyshard.trainer import ConfigError

    if dry_run:
        check_fits(config, nproc, anywhere=True)  # a plan may be for a larger machine, not for no machine
    try:
        check_processes(nproc)
        check_fits(config, nproc)
    except ConfigError as err:
        if not dry_run:
            raise
        return str(err)
    return None


def _planned(
    settings: dict[str, Any], nproc: int | None, nodes: tuple[int, int], profile: str | None
) -> tuple[dict[str, Any], PlannedStep]:
    """``settings`` laid out as the planner chose for ``nproc`` processes per node (printed with why),
    and the planner's prediction for that layout."""
    from polyshard.cli.plan import default_profile
    from polyshard.planner.auto import choose, explain, laid_out, prediction
    from polyshard.planner.profile import load_profile
    from polyshard.trainer import ConfigError, from_dict

    if nproc is None:
        raise ConfigError("--layout auto needs --nproc: the processes (per node) the planner lays the model out on")
    if nodes[0] != nodes[1]:
        raise ConfigError("--layout auto plans for a fixed number of nodes; give --nnodes=N, not MIN:MAX")
    devices = nproc * nodes[0]
    parsed = from_dict(settings, world_size=devices)
    plan = choose(parsed, devices, load_profile(profile or default_profile()), devices_per_node=nproc)
    typer.echo(explain(plan))
    best = plan.ranked[0]
    return laid_out(settings, best), prediction(best)


def _nodes(torchrun_args: list[str]) -> tuple[int, int]:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic job (1 when not given)."""
    for arg in torchrun_args:
        if arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
            parts = value.split(":")
            if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) > int(parts[-1]):
                raise typer.BadParameter(f"--nnodes={value}: give N or MIN:MAX nodes", param_hint="--torchrun")
            return int(parts[0]), int(parts[-1])
    return 1, 1
