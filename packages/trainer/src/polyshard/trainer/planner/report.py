"""The plan as a table: one line per layout, fastest first, with where the step's time goes."""

from __future__ import annotations

from collections.abc import Sequence

from polyshard.trainer.planner.search import Candidate

COLUMNS = (
    ("#", 3),
    ("layout", 36),
    ("step s", 9),
    ("pipeline", 9),
    ("dp", 8),
    ("optim", 8),
    ("GB/rank", 8),
    ("states", 7),
    ("acts", 7),
    ("tp GB", 7),
    ("pp GB", 7),
    ("dp GB", 7),
)
"""pipeline: compute, in-stage collectives, transfers and bubbles (the simulator's step); dp: exposed
gradient reduction and ZeRO's gathers after it; optim: the AdamW step. GB/rank: the heaviest rank's
memory (model states + activations). tp/pp/dp GB: bytes one rank sends per step on that axis."""


def _cells(rank: int, c: Candidate) -> list[str]:
    gb = c.memory.as_gb()
    parts = c.step.parts if c.step else {}
    seconds = [c.step_s, parts.get("pipeline", 0.0), parts.get("dp", 0.0), parts.get("optimizer", 0.0)]
    sent = [c.comm_bytes.get(axis, 0.0) / 1e9 for axis in ("tp", "pp", "dp")]
    memory = [gb["total"], gb["params"] + gb["grads"] + gb["optimizer"], gb["activations"]]
    return [str(rank), c.layout.label(), *(f"{v:.4g}" for v in seconds), *(f"{v:.3g}" for v in memory + sent)]


def table(ranked: Sequence[Candidate]) -> str:
    """A header and one line per candidate (see :data:`COLUMNS`)."""

    def line(cells: Sequence[str]) -> str:
        first, name, *rest = zip(cells, (width for _, width in COLUMNS))
        return f"{first[0]:>{first[1]}}  {name[0]:<{name[1]}}" + "".join(f" {c:>{w}}" for c, w in rest)

    return "\n".join([line([h for h, _ in COLUMNS]), *(line(_cells(i + 1, c)) for i, c in enumerate(ranked))])
