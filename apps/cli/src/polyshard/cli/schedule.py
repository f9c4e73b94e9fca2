"""``polyshard schedule NAME``: a pipeline schedule's grid, bubble and peak activations, from the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def schedule_command(
    name: str = typer.Argument(..., help="gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev."),
    stages: int = typer.Option(..., "--stages", "-p", help="Pipeline ranks p."),
    microbatches: int = typer.Option(..., "--microbatches", "-m", help="Microbatches m per step."),
    virtual_stages: int | None = typer.Option(
        None, "--virtual-stages", "-v", help="Stages per rank (interleaved, default 2; zb-v and dualpipev take 2)."
    ),
    svg: Path | None = typer.Option(None, "--svg", help="Also draw the simulated timeline to this SVG file."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
) -> None:
    """Simulate a schedule (F = B = W = 1) and print its grid, timeline, bubble and peak activations."""
    from polyshard.pp import DeadlockError, ScheduleError, make_schedule, simulate

    try:
        result = simulate(make_schedule(name, stages, microbatches, virtual_stages))
    except (ScheduleError, DeadlockError) as err:
        raise typer.BadParameter(str(err)) from err
    schedule = result.schedule
    virtual_stages = schedule.virtual_stages
    title = f"{name} p={stages} m={microbatches}" + (f" v={virtual_stages}" if virtual_stages > 1 else "")
    per_unit = max(1, min(4, 160 // max(1, int(result.total_time))))  # whole columns per unit of time
    chart = result.timeline.render_text(per_unit * int(result.total_time))
    typer.echo(f"{title}\n\n{schedule.grid()}\n\n{chart}\n")
    typer.echo(f"bubble fraction  {result.bubble_fraction:.4f}")
    typer.echo(f"total time       {result.total_time:g}  (F = B = W = 1)")
    typer.echo(f"peak activations {list(result.peak_activations)}  (per rank)")
    if svg is not None:
        svg.write_text(result.timeline.to_svg(title=f"{title}  simulated bubble {result.bubble_fraction:.3f}"))
    if json_path is not None:
        figures = {
            "schedule": name,
            "stages": stages,
            "microbatches": microbatches,
            "bubble_fraction": result.bubble_fraction,
            "peak_activations": list(result.peak_activations),
            "total_time": result.total_time,
        }
        json_path.write_text(json.dumps(figures, indent=2))
