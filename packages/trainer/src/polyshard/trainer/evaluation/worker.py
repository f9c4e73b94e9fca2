"""The process ``polyshard eval`` starts on each rank under torchrun: build the engine on the layout, load the
checkpoint's weights into it (from any layout it was saved on), run lm_eval's tasks through
:class:`~polyshard.trainer.evaluation.harness.MeshLM`; rank 0 prints the table and writes ``--output``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyshard.checkpoint import Checkpoint, CheckpointError
from polyshard.trainer.errors import ConfigError, DataError
from polyshard.trainer.evaluation import EvaluationError, require_lm_eval

# What the results JSON keeps of lm_eval's answer (its samples only with --log-samples).
RESULT_KEYS = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="polyshard evaluation worker (launched by `polyshard eval`)")
    p.add_argument("--checkpoint", required=True, help="the step folder to evaluate")
    p.add_argument("--mesh", required=True, help='the layout as JSON, e.g. {"dp": 2}')
    p.add_argument("--tasks", required=True, help="comma-separated lm_eval task names")
    p.add_argument("--include-path", default=None, help="a folder of task YAML files")
    p.add_argument("--limit", type=float, default=None)
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--output", default=None, help="the results JSON to write (rank 0)")
    p.add_argument("--log-samples", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:  # one progress bar and one log: rank 0's (every rank computes the same metrics)
        os.environ["TQDM_DISABLE"] = "1"
    from polyshard.trainer.runtime.lifetime import die_with_parent

    die_with_parent()
    try:
        record = evaluate(args)
    except (ConfigError, DataError, CheckpointError, EvaluationError, ImportError) as err:
        # Every rank meets the same mistake (they read the same checkpoint, tasks and requests): rank 0 says it.
        if rank == 0:
            print(f"eval error: {err}", file=sys.stderr, flush=True)
        os._exit(2)  # torchrun stops the other ranks, which may be waiting for this one
    if record is not None:
        write_results(record, args.output)


def evaluate(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank evaluates; rank 0 returns what to report (the others None)."""
    lm_eval = require_lm_eval()
    import torch.distributed as dist

    from polyshard.mesh import Mesh, init_distributed
    from polyshard.trainer.evaluation.harness import evaluate_checkpoint
    from polyshard.trainer.evaluation.layout import evaluation_config

    source = Checkpoint(args.checkpoint)
    config = evaluation_config(source, json.loads(args.mesh))
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    tasks = task_manager(names, args.include_path)
    ctx = init_distributed(mesh_axes=config.parallel.mesh_axes, timeout_s=config.parallel.timeout_s)
    if ctx.rank != 0:
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    mesh = Mesh(config.parallel.mesh_axes, timeout_s=config.parallel.timeout_s)
    options = {"num_fewshot": args.num_fewshot, "limit": args.limit, "log_samples": args.log_samples}
    results = evaluate_checkpoint(source, config, mesh, names, tasks, batch_size=args.batch_size, **options)
    dist.barrier()
    dist.destroy_process_group()
    if ctx.rank != 0 or results is None:
        return None
    print(lm_eval.utils.make_table(results), flush=True)
    layout = {"checkpoint": str(source.folder), "step": source.step, "mesh": config.parallel.mesh_axes}
    record = {"polyshard": {**layout, "batch_size": args.batch_size}}
    record |= {key: results[key] for key in RESULT_KEYS if key in results}
    if args.log_samples:
        record["samples"] = results.get("samples", {})
    return record


def task_manager(names: Sequence[str], include_path: str | None) -> Any:
    """lm_eval's TaskManager that knows ``names``. Indexing lm_eval's thousands of built-in tasks takes
    seconds, so when ``include_path`` holds every task named, only that folder is indexed."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(local.match_tasks([name]) for name in names):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [name for name in names if not manager.match_tasks([name])]
    if unknown:
        where = "lm_eval's tasks" + (f" or {include_path}" if include_path else "")
        raise EvaluationError(
            f"--tasks: {', '.join(unknown)} not found among {where}; `lm_eval ls tasks` lists them, "
            "--include-path adds a folder of task YAML files"
        )
    return manager


def write_results(record: dict[str, Any], output: str | None) -> None:
    """The results JSON, written under a private name and renamed into place (whole or absent)."""
    if output is None:
        return
    from lm_eval.utils import handle_non_serializable

    path = Path(output)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    tmp.replace(path)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
