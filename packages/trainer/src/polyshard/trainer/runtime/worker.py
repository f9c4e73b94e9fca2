"""The worker entry point ``polyshard train`` launches under torchrun (one process per rank).

It reads the config the launcher resolved into the run folder
(:data:`polyshard.trainer.runtime.launch.RESOLVED_CONFIG`), never the TOML file or the overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from polyshard.checkpoint import CheckpointError
from polyshard.collectives.flight import describe_failure, is_comm_failure
from polyshard.mesh import Mesh, init_distributed
from polyshard.trainer.engine.constraints import validate
from polyshard.trainer.errors import ConfigError, DataError, NonFiniteError, ReplicaMismatchError
from polyshard.trainer.loop import saved_by_this_job, train
from polyshard.trainer.loop.plan_check import PlannedStep
from polyshard.trainer.runtime.heartbeat import Heartbeat
from polyshard.trainer.runtime.launch import RESOLVED_CONFIG, USER_ERROR_MARK, read_resolved
from polyshard.trainer.runtime.lifetime import die_with_parent, quiet_interrupts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="polyshard training worker (launched by `polyshard train`)")
    parser.add_argument("--out", required=True, help="the run folder, holding the resolved config.json")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--init-from", default=None)
    parser.add_argument("--plan", default=None, help="the planner's prediction for this layout (plan.json)")
    args = parser.parse_args(argv)
    die_with_parent()  # no worker trains on after its launcher is gone
    quiet_interrupts()
    # torchrun's WORLD_SIZE: after an elastic restart it counts the processes present now.
    world_size = int(os.environ.get("WORLD_SIZE", "0")) or None
    config = read_resolved(Path(args.out) / RESOLVED_CONFIG, world_size)
    prediction = PlannedStep.read(args.plan) if args.plan else None
    ctx = init_distributed(mesh_axes=config.parallel.mesh_axes, timeout_s=config.parallel.timeout_s)
    validate(config, world_size=ctx.world_size)
    out = Path(args.out)
    resume, init_from = args.resume, args.init_from
    if saved_by_this_job(out):
        # torchrun restarted the worker group (a crash, or nodes lost or joined): continue from the
        # latest checkpoint this job wrote, the same path as --resume (the metrics log is cut back to
        # it). Every rank reads the same index, so all decide alike, whatever their restart counts.
        resume, init_from = True, None
        if ctx.rank == 0:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
            print(
                f"restart {restart} of the worker group ({ctx.world_size} processes, mesh "
                f"{config.parallel.mesh_axes}): resuming from the latest checkpoint",
                flush=True,
            )
    heartbeat, mesh = Heartbeat(ctx.rank, ctx.world_size), None
    try:
        mesh = Mesh(config.parallel.mesh_axes, timeout_s=config.parallel.timeout_s)
        result = train(config, mesh, out, resume=resume, init_from=init_from, prediction=prediction)
    except (NonFiniteError, ReplicaMismatchError) as err:  # every rank raises it at the same step
        if ctx.rank == 0:
            ended = "non-finite" if isinstance(err, NonFiniteError) else "replicas-differ"
            _write_summary(out, {"ended": ended, "error": str(err)})
            print(f"training stopped: {err}", file=sys.stderr, flush=True)
        dist.barrier()
        dist.destroy_process_group()
        raise SystemExit(3) from None
    except (ConfigError, DataError, CheckpointError) as err:  # a user's mistake the launcher could not see
        if _first_to_report(out):  # every rank may meet the same mistake: the user reads it once
            print(f"{type(err).__name__} on rank {ctx.rank}: {err}", file=sys.stderr, flush=True)
        os._exit(2)  # torchrun stops the other ranks, which may be waiting for this one
    except Exception as err:
        if is_comm_failure(err):
            _report_comm_failure(err, mesh, heartbeat, out, config.parallel.timeout_s)
        raise
    if ctx.rank == 0:
        if result.sample is not None:
            print(f"--- sample ---\n{result.sample}\n--------------")
        last = config.training.last_step
        summary = result.summary(last)
        ended = "completed" if last == config.training.steps else f"stopped at step {last} (training.stop_at)"
        _write_summary(out, {"ended": ended, "losses": result.losses, **result.speed, "summary": summary})
        print(summary, flush=True)
    heartbeat.stop()
    dist.barrier()
    dist.destroy_process_group()


def _first_to_report(out: Path) -> bool:
    """Whether this rank is the first of the job to report a user error (an exclusive create decides)."""
    try:
        os.close(os.open(out / USER_ERROR_MARK, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    except OSError:
        return True  # the folder cannot be written: better twice than never
    return True


def _write_summary(out: Path, record: dict[str, Any]) -> None:
    """``summary.json``, replaced whole (several ranks may report one failure at once)."""
    tmp = out / f".summary.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(out / "summary.json")


def _report_comm_failure(err: Exception, mesh: Mesh | None, heartbeat: Heartbeat, out: Path, timeout_s: float) -> None:
    """A collective timed out or lost a peer: say which call, group and ranks, and which ranks stopped
    beating, then exit at once (code 4). The process group cannot be torn down cleanly with a peer
    missing, so this rank does not try; torchrun sees the exit and stops every other worker."""
    message = describe_failure(err, mesh.name_of if mesh is not None else None)
    silent = heartbeat.stale_ranks()
    if silent:
        ages = ", ".join(f"rank {r} for {age:.0f} s" for r, age in sorted(silent.items()))
        message += f". No heartbeat from {ages}: stopped, dead or stuck there; look at that rank first"
    message += f" (parallel.timeout_s={timeout_s})"
    print(f"communication failure: {message}", file=sys.stderr, flush=True)
    try:
        _write_summary(out, {"ended": "communication failure", "error": message, "silent_ranks": sorted(silent)})
    finally:
        os._exit(4)


if __name__ == "__main__":
    main()
