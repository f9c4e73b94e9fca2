"""Injected faults, to prove that a run survives them (chaos testing).

``POLYSHARD_FAULT="<point>@<step>:<rank>"`` kills rank ``<rank>`` with SIGKILL at ``<point>`` of
step ``<step>``; several faults are separated by commas. Points:

- ``step``: in the middle of a step (the batch is taken, the weights are not yet updated);
- ``save``: in the middle of a checkpoint (this rank's file is written, the index is not);
- ``saved``: right after a checkpoint is published.

A fault fires in the first attempt only, so a run restarted by torchrun (``--max-restarts``) goes on.
"""

from __future__ import annotations

import os
import signal

POINTS = ("step", "save", "saved")


def parse(spec: str) -> list[tuple[str, int, int]]:
    """``"save@4:1,step@2:0"`` -> ``[("save", 4, 1), ("step", 2, 0)]``; a malformed spec is an error."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            point, rest = item.split("@")
            step, rank = (int(v) for v in rest.split(":"))
        except ValueError:
            raise ValueError(f"POLYSHARD_FAULT={spec!r}: write <point>@<step>:<rank>, e.g. save@4:1") from None
        if point not in POINTS:
            raise ValueError(f"POLYSHARD_FAULT={spec!r}: point {point!r} is not one of {POINTS}")
        faults.append((point, step, rank))
    return faults


def inject(point: str, step: int, rank: int) -> None:
    """Kill this process if a fault is set for ``point`` at ``step`` on ``rank`` (first attempt only)."""
    spec = os.environ.get("POLYSHARD_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if (point, step, rank) in parse(spec):
        os.kill(os.getpid(), signal.SIGKILL)
