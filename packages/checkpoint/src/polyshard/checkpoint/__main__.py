"""``polyshard-checkpoint`` (or ``python -m polyshard.checkpoint``): checkpoints without the trainer.

polyshard-checkpoint inspect RUN_OR_STEP          names, global shapes, sizes; every sha256 verified
polyshard-checkpoint export RUN_OR_STEP OUT.safetensors   the plain model's weights, one file
polyshard-checkpoint reshard STEP DST --mesh dp=2   every tensor (weights, optimizer state) whole on every rank
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from polyshard.checkpoint.export import describe, export
from polyshard.checkpoint.format import RNG, CheckpointError
from polyshard.checkpoint.reshard import plans_from_records, write_resharded
from polyshard.checkpoint.save import open_checkpoint


def _mesh(text: str) -> dict[str, int]:
    mesh = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        axis, _, size = item.partition("=")
        if not axis.isidentifier() or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: write axis=size, e.g. --mesh dp=2,tp=1")
        mesh[axis] = int(size)
    if not mesh:
        raise argparse.ArgumentTypeError("give at least one axis, e.g. --mesh dp=1")
    return mesh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="polyshard-checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="names, global shapes and sizes; checksums verified")
    inspect.add_argument("checkpoint", type=Path)
    out = commands.add_parser("export", help="one safetensors file of the unsharded weights")
    out.add_argument("checkpoint", type=Path)
    out.add_argument("destination", type=Path)
    out.add_argument("--overwrite", action="store_true", help="replace a file already there")
    reshard = commands.add_parser(
        "reshard", help="every tensor whole (replicated) on every rank of another mesh: the records need no model"
    )
    reshard.add_argument("checkpoint", type=Path)
    reshard.add_argument("destination", type=Path, help="folder to write step_<N>/ into")
    reshard.add_argument("--mesh", type=_mesh, required=True, help="e.g. dp=2 (axes and sizes)")
    reshard.add_argument("--overwrite", action="store_true", help="replace a step_<N>/ folder already there")
    args = parser.parse_args(argv)

    def skipped(folder: Path, err: CheckpointError) -> None:
        print(f"skipping {folder}: {err}", file=sys.stderr)

    try:
        source = open_checkpoint(args.checkpoint, skipped)
        if args.command == "inspect":
            print(describe(source))
        elif args.command == "export":
            print(f"wrote {export(source, args.destination, overwrite=args.overwrite)}")
        else:
            # No model is needed: every tensor (weights and optimizer state) whole on every target rank.
            plans = plans_from_records(dict.fromkeys((k for k in source.pieces if k != RNG), None), args.mesh, source)
            print(write_resharded(source, args.destination, args.mesh, plans, overwrite=args.overwrite))
    except (CheckpointError, OSError) as err:
        print(f"checkpoint error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
