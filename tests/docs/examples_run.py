"""Run the commands the learning path shows and compare their output with the page.

A page marks a command and the output it printed like this (the block right under the marker)::

    <!-- run: python examples/03_data_parallel.py | atol=1e-6 rtol=0 long -->
    ```text
    ...the output...
    ```

The comparison is line by line: the words must be equal, every number within ``atol + rtol x |page|``
of the page's. A line that starts with ``measured`` depends on the machine (times, bandwidths): its
words are compared, its numbers are not. ``long`` puts the run under ``pytest -m long``.

``python -m tests.docs.examples_run --write`` runs every marked command and writes its output into
the pages (after a change to an example); review the diff before committing.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
MARKER = re.compile(r"<!-- run: (?P<command>.+?)(?: \| (?P<options>[^>]*?))? -->\n```text\n(?P<output>.*?)```", re.S)
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


@dataclass(frozen=True)
class Run:
    page: Path
    command: str
    output: str
    atol: float = 0.0
    rtol: float = 0.0
    long: bool = False

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT / 'docs')}: {self.command}"


def runs() -> list[Run]:
    found = []
    for page in PAGES:
        for match in MARKER.finditer(page.read_text()):
            options = dict(atol="0", rtol="0")
            flags = set()
            for word in (match["options"] or "").split():
                key, _, value = word.partition("=")
                if value:
                    options[key] = value
                else:
                    flags.add(key)
            found.append(
                Run(
                    page,
                    match["command"],
                    match["output"],
                    float(options["atol"]),
                    float(options["rtol"]),
                    "long" in flags,
                )
            )
    return found


def execute(command: str, timeout_s: float = 600) -> str:
    """Run a page's command from the repository root with this interpreter and its polyshard script."""
    argv = shlex.split(command)
    bin_dir = Path(sys.executable).parent
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "polyshard":
        argv[0] = str(bin_dir / "polyshard")
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"`{command}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def differences(run: Run, output: str) -> list[str]:
    """Lines where ``output`` leaves the page's figures' tolerance (empty: it matches)."""
    page_lines, new_lines = run.output.rstrip("\n").splitlines(), output.rstrip("\n").splitlines()
    if len(page_lines) != len(new_lines):
        return [f"{len(new_lines)} lines printed, the page shows {len(page_lines)}"]
    problems = []
    for shown, printed in zip(page_lines, new_lines):
        if NUMBER.sub("#", shown).split() != NUMBER.sub("#", printed).split():
            problems.append(f"words differ:\n  page: {shown}\n  now:  {printed}")
            continue
        if shown.lstrip().startswith("measured"):
            continue
        for a, b in zip(NUMBER.findall(shown), NUMBER.findall(printed)):
            if abs(float(b) - float(a)) > run.atol + run.rtol * abs(float(a)):
                problems.append(
                    f"{b} leaves {a} ± (atol {run.atol} + rtol {run.rtol}):\n  page: {shown}\n  now:  {printed}"
                )
    return problems


def write_all() -> None:
    for page in PAGES:
        text = page.read_text()

        def fresh(match: re.Match[str]) -> str:
            print(f"running {match['command']}", flush=True)
            return match[0].replace(match["output"], execute(match["command"]).rstrip("\n") + "\n")

        new = MARKER.sub(fresh, text)
        if new != text:
            page.write_text(new)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_all()
    else:
        for run in runs():
            print(("long  " if run.long else "fast  ") + run.name)
