"""The docs name only what exists: links, files, modules, CLI flags and quoted error messages.

Pages: everything under docs/, the README and each package's README. Checked:

- every relative Markdown link points at a file (mkdocs --strict also checks the site's own links);
- every backticked path under packages/, apps/, examples/, tests/, benchmarks/ or docs/ exists;
- every backticked ``polyshard.x.y`` imports as a module, or names an attribute of one;
- every ``--flag`` of a ``polyshard <command>`` line in a code block or backticks is an option of
  that command (read from the typer app, as ``--help`` lists them);
- every troubleshooting heading quotes text that still occurs in the source (``…`` separates pieces).
"""

import importlib
import re
from pathlib import Path

import pytest
import typer.main

from polyshard.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"] + sorted(ROOT.glob("packages/*/README.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
PATH = re.compile(r"^(?:packages|apps|examples|tests|benchmarks|docs)/[\w./*-]+$")
MODULE = re.compile(r"^polyshard(?:\.\w+)+$")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _spans(text: str) -> list[str]:
    return CODE_SPAN.findall(FENCE.sub("", text))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_resolve(page):
    broken = []
    for target in LINK.findall(CODE_SPAN.sub("", FENCE.sub("", page.read_text()))):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{_rel(page)}: links to missing files {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_files_exist(page):
    missing = []
    for span in _spans(page.read_text()):
        candidate = re.split(r"::|:\d", span.strip())[0].rstrip("/.,")
        if not PATH.match(candidate):
            continue
        base = ROOT if not page.name == "README.md" or page.parent == ROOT else page.parent
        if not (list(ROOT.glob(candidate)) or list(base.glob(candidate))):
            missing.append(candidate)
    assert not missing, f"{_rel(page)}: names files that do not exist {missing}"


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_modules_import(page):
    text = page.read_text()
    names = {span.strip().split("(")[0] for span in _spans(text) if MODULE.match(span.strip().split("(")[0])}
    names |= set(re.findall(r"^::: (polyshard[\w.]*)", text, re.M))
    unknown = sorted(n for n in names if not _resolves(n))
    assert not unknown, f"{_rel(page)}: names modules or objects that do not exist {unknown}"


def _options(command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")} | {
        "--help"
    }


CLI = typer.main.get_command(app)


def _command_lines(text: str) -> list[str]:
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()]
    lines += _spans(text)
    joined, out = "", []
    for line in lines:  # continuation lines ending in "\" belong to the command above
        joined += line.rstrip("\\") + " "
        if not line.rstrip().endswith("\\"):
            out.append(joined.strip())
            joined = ""
    return [
        re.sub(r"^.*?\bpolyshard ", "polyshard ", line) for line in out if re.search(r"(^|[\s/])polyshard [a-z]", line)
    ]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_cli_flags_exist(page):
    wrong = []
    for line in _command_lines(page.read_text()):
        words = line.split("#")[0].split()
        if len(words) < 2 or words[1] not in CLI.commands:
            continue
        command = CLI.commands[words[1]]
        if hasattr(command, "commands"):  # a group (bench): the flags belong to its subcommand
            if len(words) < 3 or words[2] not in command.commands:
                continue
            command = command.commands[words[2]]
        if getattr(command, "context_settings", {}).get("allow_extra_args"):
            continue  # passes its other flags on to a benchmark script
        known = _options(command)
        for word in words[2:]:
            flag = word.split("=")[0]
            if re.fullmatch(r"--[a-z][\w-]*", flag) and flag not in known:
                wrong.append(f"{words[1]} {flag}")
    assert not wrong, f"{_rel(page)}: flags the CLI does not have {sorted(set(wrong))}"


def _source_text() -> str:
    files = [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("apps/cli/src/**/*.py")]
    return "\n".join(f.read_text() for f in files)


def test_troubleshooting_messages_exist():
    page = ROOT / "docs" / "guides" / "troubleshooting.md"
    quoted = re.findall(r"^### `(.+)`$", page.read_text(), re.M)
    assert len(quoted) >= 10
    source = _source_text()
    missing = [q for q in quoted if not all(piece.strip() in source for piece in q.split("…") if piece.strip())]
    assert not missing, f"troubleshooting quotes messages no longer in the source: {missing}"
