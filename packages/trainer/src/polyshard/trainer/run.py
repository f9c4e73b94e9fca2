"""The worker entry point ``polyshard train`` launches under torchrun (one process per rank)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from polyshard.mesh import Mesh, init_distributed
from polyshard.trainer.config import load_config
from polyshard.trainer.constraints import validate
from polyshard.trainer.errors import NonFiniteError
from polyshard.trainer.loop import train


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="polyshard training worker (launched by `polyshard train`)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--init-from", default=None)
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    ctx = init_distributed(mesh_axes=config.parallel.mesh_axes, timeout_s=config.parallel.timeout_s)
    validate(config, world_size=ctx.world_size)
    out = Path(args.out)
    try:
        mesh = Mesh(config.parallel.mesh_axes, timeout_s=config.parallel.timeout_s)
        try:
            result = train(config, mesh, out, resume=args.resume, init_from=args.init_from)
        except NonFiniteError as err:  # every rank raises it at the same step
            if ctx.rank == 0:
                (out / "summary.json").write_text(json.dumps({"ended": "non-finite", "error": str(err)}, indent=1))
                print(f"training stopped: {err}", file=sys.stderr, flush=True)
            dist.barrier()
            raise SystemExit(3) from None
        if ctx.rank == 0:
            if result.sample is not None:
                print(f"--- sample ---\n{result.sample}\n--------------")
            summary = result.summary(config.training.steps)
            record = {"ended": "completed", "losses": result.losses, "summary": summary}
            (out / "summary.json").write_text(json.dumps(record, indent=1))
            print(summary, flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
