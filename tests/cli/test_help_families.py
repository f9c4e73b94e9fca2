"""Help texts that name model families list every family of the registry, read when the help is shown."""

import dataclasses
import re

import pytest
from typer.testing import CliRunner

from polyshard.cli.families import HF_FAMILIES
from polyshard.cli.main import app
from polyshard.models.registry import SPECS

COMMANDS = [["train", "--help"], ["export", "--help"]]


def _help(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return re.sub(r"[\s│]+", "", result.output)  # rich wraps lines and draws boxes: compare the words alone


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: a[0])
def test_the_help_names_every_registered_hugging_face_family(args):
    text = _help(args)
    titles = [family.title for spec in SPECS.values() for family in spec.hf_adapters]
    assert len(titles) >= 10 and {"GPT-2", "Llama", "DeepSeek-V3", "gpt-oss"} <= set(titles)
    assert [t for t in titles if t not in text] == []
    assert HF_FAMILIES not in text and "GPT-2orLlama" not in text


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: a[0])
def test_a_family_registered_later_shows_in_the_next_help(args, monkeypatch):
    gpt = SPECS["gpt"]
    made_up = dataclasses.replace(gpt.hf_adapters[0], model_type="made_up", title="Made-Up-Family")
    monkeypatch.setitem(SPECS, "gpt", dataclasses.replace(gpt, hf_adapters=(*gpt.hf_adapters, made_up)))
    assert "Made-Up-Family" in _help(args)
    monkeypatch.undo()
    assert "Made-Up-Family" not in _help(args)  # filled for each print, not written into the command once


def test_the_command_line_starts_without_the_registry():
    # Why the families are filled in at print time: the registry imports torch, seconds before any command.
    import subprocess
    import sys

    code = "import sys, polyshard.cli.main; print(sorted(m for m in ('torch', 'polyshard.models') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
