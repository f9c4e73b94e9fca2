"""The plan as a table: one line per layout, fastest first, with where the step's time goes."""

from __future__ import annotations

from collections.abc import Sequence

from polyshard.models.config import ModelConfig
from polyshard.models.flops import flops_per_token
from polyshard.planner.search import Candidate, label

COLUMNS = (
    ("#", 3),
    ("layout", 46),
    ("step s", 9),
    ("pipeline", 9),
    ("dp", 8),
    ("optim", 8),
    ("{unit}/rank", 8),
    ("states", 7),
    ("acts", 7),
)
"""pipeline: compute, in-stage collectives, transfers and bubbles (the simulator's step); dp: exposed
gradient reduction and ZeRO's gathers after it; optim: the AdamW step. {unit}/rank: the heaviest rank's
memory (model states + activations). Then per axis (tp, pp, dp; ep and cp where a layout uses them):
bytes one rank sends per step on it. The unit is GB (1e9 bytes), or MB for small models."""
AXIS_WIDTH = 7


def _cells(rank: int, c: Candidate, scale: float, axes: Sequence[str]) -> list[str]:
    s = c.memory.states
    parts = c.step.parts if c.step else {}
    seconds = [c.step_s, parts.get("pipeline", 0.0), parts.get("dp", 0.0), parts.get("optimizer", 0.0)]
    sent = [c.comm_bytes.get(axis, 0.0) for axis in axes]
    memory = [c.memory.total, s.total, c.memory.activations]
    return [str(rank), label(c.config), *(f"{v:.4g}" for v in seconds), *(f"{v / scale:.3g}" for v in memory + sent)]


def table(ranked: Sequence[Candidate]) -> str:
    """A header and one line per candidate (see :data:`COLUMNS`)."""
    unit, scale = ("GB", 1e9) if max((c.memory.total for c in ranked), default=0.0) >= 1e9 else ("MB", 1e6)
    # dp_shard, dp_replicate: hybrid sharding's (ZeRO's, the copies'); cp_ulysses, cp_ring: the 2-D cp scheme's
    optional = ("ep", "cp", "cp_ulysses", "cp_ring", "dp_shard", "dp_replicate")
    axes = ["tp", "pp", "dp"] + [a for a in optional if any(c.comm_bytes.get(a) for c in ranked)]
    widths = [width for _, width in COLUMNS] + [AXIS_WIDTH] * len(axes)

    def line(cells: Sequence[str]) -> str:
        first, name, *rest = zip(cells, widths)
        return f"{first[0]:>{first[1]}}  {name[0]:<{name[1]}}" + "".join(f" {c:>{w}}" for c, w in rest)

    header = [h.format(unit=unit) for h, _ in COLUMNS] + [f"{axis} {unit}" for axis in axes]
    return "\n".join([line(header), *(line(_cells(i + 1, c, scale, axes)) for i, c in enumerate(ranked))])


def flops_line(model: ModelConfig, tokens: int) -> str:
    """The FLOP count the step times rest on and its convention (the one MFU uses too), for ``polyshard plan``."""
    return (
        f"FLOPs per token {flops_per_token(model):.4g} (polyshard.models.flops: 6N + 6·s·n(Dqk + Dv)/2 per "
        f"attention layer at s = {tokens}, N the matmul weights: PaLM's 6N + 12·l·h·s with causal attention's "
        "masked half left out); recompute adds the forward again"
    )
