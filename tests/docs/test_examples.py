"""Every command the learning path shows runs, and prints what its page says within the stated tolerance.

The fast ones run in ``make test``; those marked ``long`` on their page (each starts worker processes)
in ``make test-long``. See tests/docs/examples_run.py for the page markers.
"""

import pytest

from .examples_run import differences, execute, runs

RUNS = runs()


def _params():
    return [pytest.param(run, id=run.name, marks=[pytest.mark.long] if run.long else []) for run in RUNS]


def test_every_learning_page_has_a_run():
    pages = {run.page.name for run in RUNS}
    from .examples_run import ROOT

    learn = {p.name for p in (ROOT / "docs" / "learn").glob("[0-9]*.md")}
    assert learn and learn <= pages, f"learning pages without a marked run: {sorted(learn - pages)}"


@pytest.mark.parametrize("run", _params())
def test_example_output_matches_page(run):
    problems = differences(run, execute(run.command))
    assert not problems, f"{run.name}:\n" + "\n".join(problems)
