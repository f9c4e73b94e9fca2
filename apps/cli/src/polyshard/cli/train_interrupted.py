"""The line an interrupted ``polyshard train`` ends with: what is kept and the command that continues.

``--resume`` reads the config and its ``--set`` flags again (the run folder's checkpoints hold the
state, not the settings), so the command given is this one, option for option, with ``--out`` the run
folder and ``--resume`` in place of ``--init-from`` (the run's own checkpoints come first now).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

# Options the continuing command leaves out: it names the run folder and --resume itself, and a dry run
# never starts anything to interrupt.
REPLACED = ("out", "resume", "init_from", "dry_run")


def continue_command(context: typer.Context, out: Path) -> list[str]:
    """``polyshard train CONFIG [the same options] --out OUT --resume``."""
    parts = ["polyshard", "train"]
    for param in context.command.params:
        value = context.params.get(param.name or "")
        if param.name in REPLACED or value in (None, False, [], ()) or value == param.default:
            continue
        if param.param_type_name == "argument":
            parts.append(str(value))
            continue
        flag = param.opts[0]
        for one in value if getattr(param, "multiple", False) else [value]:
            if getattr(param, "is_flag", False):
                parts.append(flag)
            elif str(one).startswith("-"):  # --torchrun=--nnodes=2: a value that looks like an option
                parts.append(f"{flag}={one}")
            else:
                parts += [flag, str(one)]
    return [*parts, "--out", str(out), "--resume"]


def interrupted_line(context: typer.Context, out: Path) -> str:
    """Said once every process has stopped after Ctrl-C."""
    from polyshard.checkpoint import latest_checkpoint

    latest = latest_checkpoint(out / "checkpoints")
    if latest is None:
        return "interrupted before the first checkpoint: nothing to resume; start the same command again"
    command = shlex.join(continue_command(context, out))
    return f"interrupted: {latest} is the last complete checkpoint; continue with: {command}"
