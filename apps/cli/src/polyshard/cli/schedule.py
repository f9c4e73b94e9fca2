"""``polyshard schedule NAME``: a pipeline schedule's grid, bubble and peak activations, from the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from polyshard.cli.outputs import report_file


def schedule_command(
    name: str = typer.Argument(..., help="gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev."),
    stages: int = typer.Option(..., "--stages", "-p", help="Pipeline ranks p."),
    microbatches: int = typer.Option(..., "--microbatches", "-m", help="Microbatches m per step."),
    virtual_stages: int | None = typer.Option(
        None, "--virtual-stages", "-v", help="Stages per rank (interleaved, default 2; zb-v and dualpipev take 2)."
    ),
    forward: float = typer.Option(1.0, "--forward", help="Time of one stage's forward (F) of one microbatch."),
    backward: float = typer.Option(1.0, "--backward", help="Time of its input-gradient backward (B)."),
    weight: float = typer.Option(1.0, "--weight", help="Time of its weight-gradient backward (W); unsplit B is B + W."),
    p2p: float = typer.Option(0.0, "--p2p", help="Time to move one activation (or gradient) between stages."),
    svg: Path | None = typer.Option(None, "--svg", help="Also draw the simulated timeline to this SVG file."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --svg or --json file if it exists."),
) -> None:
    """Simulate a schedule with the given action costs and print its grid, timeline, bubble and peak activations."""
    from polyshard.pp import DeadlockError, ScheduleError, make_schedule, simulate

    costs = {"F": forward, "B": backward, "W": weight}
    svg = report_file("schedule", "--svg", svg, overwrite)
    json_path = report_file("schedule", "--json", json_path, overwrite)
    for option, value in {**costs, "p2p": p2p}.items():
        if not 0 <= value < float("inf") or (option != "p2p" and value == 0):
            flag = {"F": "--forward", "B": "--backward", "W": "--weight", "p2p": "--p2p"}[option]
            raise typer.BadParameter(f"{value} must be a finite time > 0 (>= 0 for --p2p)", param_hint=flag)
    try:
        result = simulate(make_schedule(name, stages, microbatches, virtual_stages), costs, comm_cost=p2p)
    except (ScheduleError, DeadlockError) as err:
        raise typer.BadParameter(str(err)) from err
    schedule = result.schedule
    virtual_stages = schedule.virtual_stages
    title = f"{name} p={stages} m={microbatches}" + (f" v={virtual_stages}" if virtual_stages > 1 else "")
    width = max(40, min(160, round(4 * result.total_time / min(costs.values()))))  # up to 4 columns per F
    chart = result.timeline.render_text(width)
    typer.echo(f"{title}\n\n{schedule.grid()}\n\n{chart}\n")
    typer.echo(f"bubble fraction  {result.bubble_fraction:.4f}")
    typer.echo(
        f"total time       {result.total_time:g}  (F = {forward:g}, B = {backward:g}, W = {weight:g}, p2p = {p2p:g}; "
        f"a backward not split into B and W takes B + W = {backward + weight:g})"
    )
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
            "costs": {**costs, "p2p": p2p},
        }
        json_path.write_text(json.dumps(figures, indent=2))
