"""The line an interrupted `polyshard train` ends with names the command that continues the run: the same
options and --set flags, --out the run folder, --resume (the SIGINT itself: tests/reliability/test_lifetime.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import torch
import typer

from polyshard.checkpoint import LocalTensor, save_checkpoint
from polyshard.cli.main import app
from polyshard.cli.train_interrupted import continue_command, interrupted_line
from polyshard.mesh import Replicate, TensorPlacement

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "apps/configs/gpt-tiny-dp.toml")
TRAIN = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]


def _parsed(args: list[str]):
    return TRAIN.make_context("train", list(args))  # the options as the command reads them, nothing run


def test_the_continuing_command_reads_back_as_this_run_resumed(tmp_path):
    args = [
        CONFIG, "--set", "optimizer.lr=3e-4", "--set", "data.source='two words'", "--nproc", "2", "--compile",
        "--stop-at", "40", "--init-from", str(tmp_path), "--layout", "auto", "--torchrun=--nnodes=1", "--force",
    ]  # fmt: skip
    run = tmp_path / "my run"
    command = continue_command(_parsed(args), run)
    assert command[:3] == ["polyshard", "train", CONFIG] and command[-3:] == ["--out", str(run), "--resume"]
    again = _parsed(shlex.split(shlex.join(command))[2:]).params  # through a shell's quoting and back
    before = _parsed(args).params
    assert again == {**before, "out": run, "resume": True, "init_from": None}  # --resume replaces --init-from
    assert _parsed(command[2:]).params["overrides"] == ["optimizer.lr=3e-4", "data.source='two words'"]


def test_the_line_names_the_last_checkpoint_or_says_there_is_none(tmp_path):
    context = _parsed([CONFIG, "--set", "training.steps=9"])
    assert interrupted_line(context, tmp_path) == (
        "interrupted before the first checkpoint: nothing to resume; start the same command again"
    )
    record = TensorPlacement("w", (2,), (("dp", Replicate()),))
    step = save_checkpoint(
        tmp_path / "checkpoints", 4, {"model/w": LocalTensor(torch.ones(2), record)}, mesh_axes={"dp": 1}
    )
    assert interrupted_line(context, tmp_path) == (
        f"interrupted: {step} is the last complete checkpoint; continue with: "
        f"polyshard train {CONFIG} --set training.steps=9 --out {tmp_path} --resume"
    )
