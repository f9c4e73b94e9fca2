"""``polyshard plan``: choose a layout before launch, from a cost model calibrated on this machine."""

from __future__ import annotations

from pathlib import Path

import typer

DEFAULT_PROFILE = Path.home() / ".cache" / "polyshard" / "profile.json"


def plan_command(
    calibrate: bool = typer.Option(False, "--calibrate", help="Measure this machine and save its profile."),
    quick: bool = typer.Option(False, "--quick", help="With --calibrate: one short round (seconds, rougher)."),
    out: Path = typer.Option(DEFAULT_PROFILE, "--out", help="With --calibrate: where to write the profile."),
) -> None:
    """Rank the layouts of a model on N devices by estimated step time (or --calibrate this machine)."""
    from polyshard.trainer.planner.calibrate import FULL, QUICK
    from polyshard.trainer.planner.calibrate import calibrate as measure

    if calibrate:
        profile = measure(plan=QUICK if quick else FULL, log=typer.echo)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(profile.to_json())
        typer.echo(f"profile written to {out} ({profile.source})")
        return
