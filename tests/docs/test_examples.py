"""Every command the learning path shows runs, and prints what its page says within the stated tolerance.

Every run is in ``make test-long`` (each starts processes or a CLI); ``long`` on a page marks the runs that
start worker processes. See tests/docs/examples_run.py for the page markers.
"""

import pytest

from .examples_run import differences, execute, runs

RUNS = runs()


def _params():
    # every run starts processes or a CLI (3-7 s each, 16 s for the "fast" ones): all in make test-long
    return [pytest.param(run, id=run.name, marks=[pytest.mark.long]) for run in RUNS]


def test_every_learning_page_has_a_run():
    pages = {run.page.name for run in RUNS}
    from .examples_run import ROOT

    learn = {p.name for p in (ROOT / "docs" / "learn").glob("[0-9]*.md")}
    assert learn and learn <= pages, f"learning pages without a marked run: {sorted(learn - pages)}"


@pytest.mark.parametrize("run", _params())
def test_example_output_matches_page(run):
    problems = differences(run, execute(run.command))
    assert not problems, f"{run.name}:\n" + "\n".join(problems)
