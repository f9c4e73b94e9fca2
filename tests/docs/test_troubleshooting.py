"""Every message the troubleshooting page quotes is produced here and compared with the page.

Each heading of docs/guides/troubleshooting.md has a trigger: the `polyshard` command line that makes
the CLI print it (run in this process through typer's runner: the checks run before any process
starts), a whole job (`long`), or a system test that compares its own output with the page
(`SYSTEM`). A heading without a trigger fails, and so does a message that drifts from its heading.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polyshard.cli.main import app

from .troubleshooting import assert_page_quotes, matches, quote_starting, quotes

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "apps" / "configs"


def _sources_with_a_typo(tmp: Path) -> list[str]:
    config = tmp / "mixture.toml"
    config.write_text('[model]\npreset = "tiny"\n[[data.sources]]\npath = "shakespeare"\nwieght = 1.0\n')
    return ["train", str(config), "--dry-run"]


def _tiny_text(tmp: Path) -> Path:
    text = tmp / "text.txt"
    text.write_text("a few words to train a tokenizer on\n")
    return text


# heading prefix -> the CLI arguments (given a scratch folder) that make `polyshard` print it
TRIGGERS: dict[str, Callable[[Path], list[str]]] = {
    "does not divide model.num_heads": lambda tmp: [
        "train",
        f"{CONFIGS}/gpt-tiny-tp.toml",
        "--set",
        "parallel.tp=3",
        "--dry-run",
    ],
    "does not divide the MLP width": lambda tmp: [
        *("train", f"{CONFIGS}/gpt-tiny-tp.toml", "--set", "model.mlp_hidden=255", "--dry-run"),
    ],
    "does not divide model.moe.num_experts": lambda tmp: [
        *("train", f"{CONFIGS}/moe-gpt-ep.toml", "--set", "parallel.ep=3", "--dry-run"),
    ],
    "--resume: no complete checkpoint": lambda tmp: [
        *("train", f"{CONFIGS}/gpt-tiny-dp.toml", "--out", str(tmp / "run"), "--resume", "--dry-run"),
    ],
    "holds no complete checkpoint": lambda tmp: ["inspect", str(tmp)],
    "has unknown key(s)": _sources_with_a_typo,
    "--layout auto needs --nproc": lambda tmp: [
        "train",
        f"{CONFIGS}/gpt-tiny-dp.toml",
        "--layout",
        "auto",
        "--dry-run",
    ],
    "parallel.dp='auto' needs": lambda tmp: [
        "train",
        f"{CONFIGS}/gpt-tiny-dp.toml",
        "--set",
        "parallel.dp='auto'",
        "--dry-run",
    ],
    "training.global_batch_size=": lambda tmp: [
        *("train", f"{CONFIGS}/gpt-shakespeare-3d.toml", "--set", "training.global_batch_size=36", "--dry-run"),
    ],
    "a BPE vocabulary needs": lambda tmp: [
        "tokenizer",
        str(_tiny_text(tmp)),
        str(tmp / "tok.json"),
        "--vocab-size=100",
    ],
}
# A run of the tiny GPT whose weights blow up at the first step: three non-finite steps stop it.
NONFINITE = ["--set", "parallel.dp=1", "--set", "optimizer.lr=1e30", "--set", "training.steps=10"]
# heading prefix -> the test file that makes the job print it and calls assert_page_quotes itself
SYSTEM = {"communication failure": ROOT / "tests" / "reliability" / "test_lifetime.py"}


def test_every_quoted_message_has_a_trigger():
    page = quotes()
    assert len(page) >= 10
    triggered = [*TRIGGERS, "non-finite for", *SYSTEM]
    untested = [q for q in page if not any(q.startswith(prefix) for prefix in triggered)]
    assert not untested, f"troubleshooting headings no test produces: {untested}"
    for prefix, test_file in SYSTEM.items():
        assert f'assert_page_quotes("{prefix}"' in test_file.read_text(), f"{test_file} no longer compares {prefix!r}"


@pytest.mark.parametrize("prefix", list(TRIGGERS))
def test_the_cli_prints_the_quoted_message_in_one_line(prefix, tmp_path):
    result = CliRunner().invoke(app, TRIGGERS[prefix](tmp_path))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{result.stderr}"
    assert_page_quotes(prefix, lines[0])


@pytest.mark.long  # a one-process job to its fourth step (10 s)
def test_a_run_that_blows_up_prints_the_quoted_message(tmp_path):
    polyshard = Path(sys.executable).parent / "polyshard"
    command = [str(polyshard), "train", str(CONFIGS / "gpt-tiny-dp.toml"), *NONFINITE, "--out", str(tmp_path / "r")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 3, done.stderr
    stopped = next(line for line in done.stderr.splitlines() if line.startswith("training stopped"))
    assert_page_quotes("non-finite for", stopped)


def test_matching_needs_every_piece_in_order():
    quote = quote_starting("does not divide model.num_heads")
    assert matches(quote, "parallel.tp=3 does not divide model.num_heads=4; choose tp in [1, 2, 4]")
    assert not matches(quote, "choose tp in [1, 2, 4]; does not divide model.num_heads=4")
    assert not matches(quote, "parallel.tp=3 does not divide model.num_heads=4")
