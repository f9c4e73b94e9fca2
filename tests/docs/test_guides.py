"""The guides' and the README's command blocks run as typed, in a fresh clone's layout.

Every command block is marked ``<!-- runs -->``, ``<!-- runs: long -->`` or ``<!-- illustration: why
-->`` (tests/docs/guide_blocks.py says what each means and how the blocks run). Here: every block is
marked, and each page's runnable blocks run in order in their own scratch clone.
"""

from __future__ import annotations

import pytest

from .guide_blocks import PAGES, ROOT, Block, command_blocks, fresh_clone, link_venv, run_block

BLOCKS = {page: command_blocks(page) for page in PAGES}


def _rel(page) -> str:
    return str(page.relative_to(ROOT))


def test_every_command_block_says_whether_it_runs():
    unmarked = [block.where for blocks in BLOCKS.values() for block in blocks if block.marker is None]
    assert not unmarked, (
        "command blocks with no <!-- runs -->, <!-- runs: long --> or <!-- illustration: why --> above them: "
        f"{unmarked}"
    )
    assert sum(block.runs for blocks in BLOCKS.values() for block in blocks) >= 8


def test_a_marker_is_read_only_from_the_line_right_above_its_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- runs -->\n```bash\necho one\n```\n\n<!-- runs: long -->\n\n```bash\necho two\n```\n"
        "<!-- illustration: needs your own folder -->\n```python\nprint(3)\n```\n```toml\n[x]\n```\n"
    )
    found = command_blocks(page)
    assert [(b.line, b.marker) for b in found] == [(2, "runs"), (8, None), (12, "illustration: needs your own folder")]
    assert found[0].runs and not found[0].long and found[0].text == "echo one\n"


def test_a_failing_command_fails_its_block_with_the_output(tmp_path):
    block = Block(ROOT / "README.md", 1, "bash", "polyshard --help > /dev/null\npolyshard nosuch\necho after\n", "runs")
    with pytest.raises(AssertionError, match="exited 2") as failure:
        run_block(block, link_venv(tmp_path))
    assert "No such command" in str(failure.value) and "+ echo after" not in str(failure.value)


def _pages(long: bool) -> list:
    marks = [pytest.mark.long] if long else []
    wanted = [p for p, blocks in BLOCKS.items() if any(b.runs and b.long == long for b in blocks)]
    return [pytest.param(page, id=_rel(page), marks=marks) for page in wanted]


@pytest.mark.parametrize("page", _pages(long=False))
def test_the_cheap_blocks_run_on_a_fresh_clone(page, tmp_path):
    clone = fresh_clone(tmp_path)
    for block in BLOCKS[page]:
        if block.runs and not block.long:
            run_block(block, clone)


@pytest.mark.parametrize("page", _pages(long=True))
def test_the_long_blocks_run_in_page_order_on_a_fresh_clone(page, tmp_path):
    clone = fresh_clone(tmp_path)
    for block in BLOCKS[page]:
        if block.long:  # the cheap ones ran in make test; a long block may not need what they wrote
            run_block(block, clone)
