"""The docs name only what exists: links, files, modules, CLI flags and quoted error messages.

Pages: everything under docs/, the README and each package's README. Checked:

- every relative Markdown link points at a file, and its ``#anchor`` at a heading of that page as the
  site slugs it (mkdocs --strict checks links between pages of the site, not a page's own anchors);
- every backticked path under packages/, apps/, examples/, tests/, benchmarks/ or docs/ exists;
- every backticked ``polyshard.x.y`` imports as a module, or names an attribute of one;
- every ``--flag`` of a ``polyshard <command>`` line in a code block or backticks is an option of
  that command (read from the typer app, as ``--help`` lists them).

The troubleshooting page's quoted messages are produced and compared in test_troubleshooting.py.
"""

import functools
import importlib
import re
from pathlib import Path

import markdown
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


@functools.cache
def _anchors(page: Path) -> frozenset[str]:
    """The ids of a page's headings, as the site makes them: Python-Markdown's toc slugs (what mkdocs.yml's
    ``toc`` gives Material; a repeated heading gets ``_1``, ``_2``), fenced code left out like superfences."""
    md = markdown.Markdown(extensions=["toc", "tables", "admonition", "pymdownx.superfences", "pymdownx.details"])
    md.convert(page.read_text())
    ids: set[str] = set()

    def walk(tokens: list[dict]) -> None:
        for token in tokens:
            ids.add(token["id"])
            walk(token["children"])

    walk(md.toc_tokens)  # type: ignore[attr-defined]  # set by the toc extension
    return frozenset(ids)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_and_anchors_resolve(page):
    """A link's file exists and its ``#anchor`` is a heading there (mkdocs --strict does not check a
    page's links to its own headings)."""
    broken = []
    for target in LINK.findall(CODE_SPAN.sub("", FENCE.sub("", page.read_text()))):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no heading #{anchor} in {path.name})")
    assert not broken, f"{_rel(page)}: broken links {broken}"


def test_anchors_are_the_sites_heading_ids():
    ids = _anchors(ROOT / "docs" / "guides" / "training.md")
    assert "mixture-of-experts-routing-rules" in ids  # "Mixture of experts: routing rules"
    assert "hybrid-sharding-hsdp" in ids  # "Hybrid sharding (HSDP)"
    assert not any(i.startswith("polyshard-train") for i in ids)  # a "# comment" in a bash block is no heading


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
