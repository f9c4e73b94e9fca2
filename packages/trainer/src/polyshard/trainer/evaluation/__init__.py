"""Standard evaluations of a checkpoint with lm-evaluation-harness, on the mesh (``polyshard eval``).

scoring.py   log-likelihoods and greedy generation on any dp x tp x pp x ep layout (no lm_eval needed)
harness.py   lm_eval's ``LM`` over them: the requests' tokenization and truncation as its HF backend's
layout.py    the run's config made ready to evaluate: the layout chosen, what evaluation refuses
worker.py    the process ``polyshard eval`` starts on each rank under torchrun

lm-evaluation-harness is the optional extra ``[eval]``; only harness.py and worker.py import it, through
:func:`require_lm_eval`, which names the extra when it is missing.
"""

from __future__ import annotations

from types import ModuleType

EXTRA = "pip install 'polyshard-trainer[eval]'"


class EvaluationError(ValueError):
    """A request the evaluation cannot serve as asked (sampling, a prompt with no room to generate, a
    missing end-of-text token); the message says which and what to change."""


def require_lm_eval() -> ModuleType:
    """The ``lm_eval`` module, or an ImportError of one line naming the extra that installs it."""
    try:
        import lm_eval
    except ImportError as err:
        raise ImportError(f"polyshard eval needs lm-evaluation-harness: {EXTRA}") from err
    module: ModuleType = lm_eval
    return module
