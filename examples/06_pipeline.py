"""Learning path 6: pipeline schedules as data. Each schedule is a list of actions per rank; the
simulator runs it with given action times (no tensor moves) and reports the idle fraction (the bubble)
and the peak activations held. Compared here with the closed-form bubbles.

Run: python examples/06_pipeline.py [--svg DIR]   (one process, a few seconds; --svg draws each timeline)
"""

import sys
from pathlib import Path

from polyshard.pp import make_schedule, simulate

P, M = 4, 8  # pipeline ranks, microbatches
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")


def formula(name: str, p: int, m: int, v: int) -> str:
    """The textbook bubble (F = B = W = 1), where one exists in closed form."""
    if name in ("gpipe", "1f1b"):
        return f"{(p - 1) / (m + p - 1):.4f}"  # (p-1)/(m+p-1): GPipe and 1F1B idle alike
    if name == "interleaved":
        return f"{(p - 1) / (v * m + p - 1):.4f}"  # v stages per rank shrink the warm-up v times
    return "-"


def main() -> None:
    svg_dir = Path(sys.argv[sys.argv.index("--svg") + 1]) if "--svg" in sys.argv else None
    print(f"p={P} ranks, m={M} microbatches, F = B = W = 1 (an unsplit backward costs B + W = 2)")
    print(f"{'schedule':<12}{'bubble':>8}{'formula':>9}{'peak in flight (max)':>22}{'step time':>11}")
    for name in SCHEDULES:
        schedule = make_schedule(name, P, M)
        v = len(schedule.stages_of(0))
        result = simulate(schedule)
        peak = max(result.peak_activations)
        print(
            f"{name:<12}{result.bubble_fraction:>8.4f}{formula(name, P, M, v):>9}{peak:>22}{result.total_time:>11.1f}"
        )
        if svg_dir is not None:
            svg_dir.mkdir(parents=True, exist_ok=True)
            (svg_dir / f"schedule-{name}.svg").write_text(result.timeline.to_svg())
    print()
    print(simulate(make_schedule("1f1b", P, M)).timeline.render_text(width=80))


if __name__ == "__main__":
    main()
