"""``polyshard train``: validate a config, then launch the workers through torchrun."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from polyshard.cli.launch import run_local


def train(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="A TOML config (see apps/configs/)."),
    nproc: int | None = typer.Option(None, "--nproc", help="Local processes (default: the mesh size in the config)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set training.lr=3e-4 (repeatable)."),
    out: Path | None = typer.Option(None, "--out", help="Run folder (default: runs/<config name>)."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the latest complete checkpoint in --out (saved on any mesh)."
    ),
    init_from: str | None = typer.Option(
        None,
        "--init-from",
        help="Start from this checkpoint (any mesh), or from a Hugging Face GPT-2 or Llama folder as hf:DIR; "
        "the new run goes to --out.",
    ),
    stop_at: int | None = typer.Option(
        None,
        "--stop-at",
        help="End at this step with a checkpoint, keeping the schedule of training.steps (a preemption window); "
        "--resume later continues exactly as an uninterrupted run.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the mesh, groups and memory per rank; start nothing."),
    layout: str | None = typer.Option(
        None,
        "--layout",
        help="auto: the layout planner chooses dp, tp, pp, ep, ZeRO, microbatches and schedule for --nproc processes "
        "(parallel.layout); manual: the axes the config gives.",
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
    from polyshard.checkpoint import CheckpointError, find_checkpoint, latest_checkpoint
    from polyshard.trainer import faults
    from polyshard.trainer.config import load_config
    from polyshard.trainer.constraints import layout_notes, validate
    from polyshard.trainer.errors import ConfigError, DataError
    from polyshard.trainer.hf import PREFIX, check_matches
    from polyshard.trainer.models import spec_of
    from polyshard.trainer.plan import describe

    if stop_at is not None:
        overrides = [*overrides, f"training.stop_at={stop_at}"]
    try:
        if resume and init_from is not None:
            raise ConfigError("give --resume (continue this run) or --init-from CKPT (start from another), not both")
        hf_folder = _hf_folder(init_from)
        if init_from is not None and hf_folder is None:
            find_checkpoint(init_from)  # a missing checkpoint is reported before any process starts
        out = out or Path("runs") / config.stem
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out} is a file; give the folder the run writes into")
        if resume and latest_checkpoint(out / "checkpoints") is None:
            raise CheckpointError(
                f"--resume: no complete checkpoint under {out / 'checkpoints'}; drop --resume to start"
            )
        low, high = _nodes(torchrun)
        if layout is not None:
            overrides = [*overrides, f"parallel.layout={json.dumps(layout)}"]
        if load_config(config, overrides, world_size=nproc * low if nproc else None).parallel.layout == "auto":
            overrides = _planned(config, overrides, nproc, (low, high), profile)
        if nproc is None:  # the config's mesh size (dp='auto' asks for --nproc here)
            nproc = load_config(config, overrides).parallel.world_size // low
        if nproc < 1:
            raise ConfigError(f"--nproc {nproc}: give at least one process per node")
        # Every size an elastic job may take must be a valid mesh.
        sizes = {nodes: load_config(config, overrides, world_size=nproc * nodes) for nodes in range(low, high + 1)}
        if low != high and sizes[low].parallel.dp == sizes[high].parallel.dp:
            raise ConfigError(f"--nnodes={low}:{high} (elastic) needs parallel.dp='auto', so dp follows the nodes")
        for nodes, parsed in sizes.items():
            validate(parsed, world_size=nproc * nodes)
        if hf_folder is not None:
            check_matches(hf_folder, parsed.model)
        spec_of(parsed.model).task.check_data(parsed)
        faults.parse(os.environ.get("POLYSHARD_FAULT", ""))
    except (ConfigError, CheckpointError, DataError, ValueError) as err:  # before any process starts
        kind = {ConfigError: "config", CheckpointError: "checkpoint", DataError: "data"}.get(type(err), "input")
        typer.echo(f"{kind} error: {err}", err=True)
        raise typer.Exit(2) from err
    for note in layout_notes(parsed):
        typer.echo(f"note: {note}")
    if dry_run:
        typer.echo(describe(parsed))
        return
    args = ["--config", str(config.resolve()), "--out", str(out.resolve())]
    for item in overrides:
        args += ["--set", item]
    if resume:
        args.append("--resume")
    if init_from is not None:
        args += ["--init-from", f"{PREFIX}{hf_folder.resolve()}" if hf_folder else str(Path(init_from).resolve())]
    raise typer.Exit(run_local(nproc, "polyshard.trainer.run", args, torchrun))


def _planned(config: Path, overrides: list[str], nproc: int | None, nodes: tuple[int, int], profile: str | None):
    """``overrides`` plus the layout the planner chose for ``nproc`` processes per node (printed with why)."""
    from polyshard.cli.plan import default_profile
    from polyshard.trainer.config import load_config
    from polyshard.trainer.errors import ConfigError
    from polyshard.trainer.planner.auto import choose, explain
    from polyshard.trainer.planner.auto import overrides as chosen
    from polyshard.trainer.planner.profile import load_profile

    if nproc is None:
        raise ConfigError("--layout auto needs --nproc: the processes (per node) the planner lays the model out on")
    if nodes[0] != nodes[1]:
        raise ConfigError("--layout auto plans for a fixed number of nodes; give --nnodes=N, not MIN:MAX")
    devices = nproc * nodes[0]
    parsed = load_config(config, overrides, world_size=devices)
    plan = choose(parsed, devices, load_profile(profile or default_profile()), devices_per_node=nproc)
    typer.echo(explain(plan))
    return [*overrides, *chosen(plan.ranked[0])]


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


def _hf_folder(init_from: str | None) -> Path | None:
    """The folder of ``--init-from hf:DIR``; None for a polyshard checkpoint."""
    from polyshard.trainer.hf import PREFIX

    return Path(init_from[len(PREFIX) :]) if init_from is not None and init_from.startswith(PREFIX) else None
