"""``polyshard eval``: lm-evaluation-harness tasks on a run's checkpoint, computed on the mesh."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import typer

from polyshard.cli.checkpoints import parse_mesh
from polyshard.cli.errors import fail
from polyshard.cli.launch import run_local

WORKER = "polyshard.trainer.evaluation.worker"


def eval_command(
    run: Path = typer.Argument(..., exists=True, help="A run folder (its latest checkpoint) or a step folder."),
    tasks: str = typer.Option(..., "--tasks", help="Comma-separated lm_eval task names, e.g. hellaswag,arc_easy."),
    step: int | None = typer.Option(None, "--step", min=0, help="Evaluate this step's checkpoint (default: latest)."),
    mesh: str | None = typer.Option(
        None, "--mesh", help="Layout to evaluate on, e.g. dp=2 or tp=2 (default: the checkpoint's own; no cp)."
    ),
    include_path: Path | None = typer.Option(
        None, "--include-path", exists=True, file_okay=False, help="A folder of your own task YAML files."
    ),
    limit: float | None = typer.Option(
        None, "--limit", min=0.0, help="Examples per task: a count, or below 1 a fraction of each task."
    ),
    num_fewshot: int | None = typer.Option(None, "--num-fewshot", min=0, help="Examples in each prompt."),
    batch_size: int = typer.Option(1, "--batch-size", min=1, help="Requests per forward on each data rank."),
    output: Path | None = typer.Option(None, "--output", help="Write the results (JSON) to this file."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --output if it exists."),
    log_samples: bool = typer.Option(False, "--log-samples", help="Keep every request and answer in --output."),
) -> None:
    """Run lm-evaluation-harness tasks on a checkpoint: log-likelihoods and greedy generation on the mesh
    (dp, tp, pp, ep; ZeRO and sequence parallelism off), one process per rank of the layout."""
    from polyshard.checkpoint import Checkpoint, CheckpointError
    from polyshard.trainer import ConfigError
    from polyshard.trainer.evaluation import require_lm_eval
    from polyshard.trainer.evaluation.layout import evaluation_config

    if output is not None:
        if output.exists() and not overwrite:
            _refuse(f"--output {output} exists; give another file, or --overwrite to replace it")
        if not output.parent.is_dir():
            _refuse(f"--output {output}: {output.parent} is not a folder; create it first")
    if not [name for name in tasks.split(",") if name.strip()]:
        _refuse("--tasks: name at least one task, e.g. --tasks hellaswag")
    if log_samples and output is None:
        _refuse("--log-samples keeps the samples in --output: give --output too")
    try:
        require_lm_eval()
        folder = _step_folder(run, step)
        config = evaluation_config(Checkpoint(folder), parse_mesh(mesh) if mesh is not None else None)
    except (CheckpointError, ConfigError, ImportError) as err:
        _refuse(str(err))
    args = ["--checkpoint", str(folder.resolve()), "--mesh", json.dumps(config.parallel.mesh_axes)]
    args += ["--tasks", tasks, "--batch-size", str(batch_size)]
    if include_path is not None:
        args += ["--include-path", str(include_path.resolve())]
    if limit is not None:
        args += ["--limit", str(limit)]
    if num_fewshot is not None:
        args += ["--num-fewshot", str(num_fewshot)]
    if output is not None:
        args += ["--output", str(output.resolve())]
    if log_samples:
        args.append("--log-samples")
    raise typer.Exit(run_local(config.parallel.world_size, WORKER, args))


def _refuse(message: str) -> NoReturn:
    """A user's mistake: one line on stderr, exit status 2, before any process starts."""
    fail("eval", message)


def _step_folder(run: Path, step: int | None) -> Path:
    """The checkpoint to evaluate: ``run``'s latest (or ``run`` itself, a step folder), or with ``step`` that one."""
    from polyshard.checkpoint import CheckpointError, complete_checkpoints, find_checkpoint, step_dir

    if step is None:
        return find_checkpoint(run)
    roots = (run, run / "checkpoints")
    for root in roots:
        if (step_dir(root, step) / "index.json").exists():
            return step_dir(root, step)
    have = ", ".join(p.name for root in roots for p in complete_checkpoints(root)) or "none"
    raise CheckpointError(f"--step {step}: {run} holds no complete {step_dir(Path(), step)} (it holds: {have})")
