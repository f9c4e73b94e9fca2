"""Timelines: when every action started and ended on every rank, as text or SVG.

The simulator and the executor both produce a :class:`Timeline`; the same
renderers draw either. Compute spans are F/B/W; communication spans are
"X" (posting a batch of sends and receives) and "R" (waiting for received
data). :meth:`Timeline.breakdown` says where each rank's time went.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

COLORS = {"F": "#4c78a8", "B": "#54a24b", "W": "#f58518", "X": "#bab0ac", "R": "#e45756"}
FILL = {"F": "f", "B": "b", "W": "w", "X": "^", "R": "~"}
COMMUNICATION = ("X", "R")


@dataclass(frozen=True)
class Span:
    rank: int
    label: str
    kind: str  # "F", "B", "W" (compute), "X" (posting sends/receives) or "R" (waiting for a receive)
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    num_ranks: int
    spans: tuple[Span, ...]
    with_stage: bool = False  # keep the stage prefix in labels ("1F3") - for interleaved schedules

    @property
    def start(self) -> float:
        return min((s.start for s in self.spans), default=0.0)

    @property
    def total_time(self) -> float:
        return max((s.end for s in self.spans), default=0.0) - self.start

    def busy(self, rank: int) -> float:
        """Time rank spends computing (F/B/W); communication waits count as bubble."""
        return sum(s.end - s.start for s in self.spans if s.rank == rank and s.kind not in COMMUNICATION)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of ranks x total time: 1 - sum of compute time / (p * step time)."""
        total = self.total_time
        if total <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.num_ranks)) / (self.num_ranks * total)

    def breakdown(self, rank: int) -> dict[str, float]:
        """Where ``rank``'s time went over the whole step (same units as the spans): ``compute``,
        ``post`` (X spans), ``wait`` (R spans), and ``other`` - the rest of the step, outside any span:
        Python between steps, and before its first or after its last step while other ranks ran."""
        mine = [s for s in self.spans if s.rank == rank]
        post = sum(s.end - s.start for s in mine if s.kind == "X")
        wait = sum(s.end - s.start for s in mine if s.kind == "R")
        compute = self.busy(rank)
        return {"compute": compute, "post": post, "wait": wait, "other": self.total_time - compute - post - wait}

    def label(self, span: Span) -> str:
        if self.with_stage or span.kind in COMMUNICATION:
            return span.label
        return span.label.lstrip("0123456789")

    def bubble_line(self, predicted: float | None = None) -> str:
        """``bubble measured 0.312 | simulator 0.273`` (the simulator's figure when given)."""
        line = f"bubble measured {self.bubble_fraction:.3f}"
        return line if predicted is None else f"{line} | simulator {predicted:.3f}"

    def render_text(self, width: int = 100, predicted_bubble: float | None = None) -> str:
        """One row per rank; each span is its label (or just F/B/W when narrow) then fill (f/b/w, ~ for exchanges).

        '.' is idle time.

        With ``predicted_bubble`` (e.g. ``simulate(schedule).bubble_fraction``) a last line puts the
        measured bubble beside the prediction.
        """
        total, origin = self.total_time or 1.0, self.start
        rows = []
        for rank in range(self.num_ranks):
            row = ["."] * width
            # communication first, so a short compute span is never hidden under a long wait
            for span in sorted((s for s in self.spans if s.rank == rank), key=lambda s: s.kind not in COMMUNICATION):
                c0 = int(round((span.start - origin) / total * width))
                c1 = max(c0 + 1, int(round((span.end - origin) / total * width)))
                text = self.label(span) if span.kind not in COMMUNICATION else ""
                if len(text) >= c1 - c0:  # too narrow for the label: just the kind letter, then fill
                    text = span.kind if span.kind not in COMMUNICATION else ""
                for i in range(c0, min(c1, width)):
                    row[i] = text[i - c0] if i - c0 < len(text) else FILL[span.kind]
            rows.append(f"rank {rank:<3}|{''.join(row)}|")
        if predicted_bubble is not None:
            rows.append(self.bubble_line(predicted_bubble))
        return "\n".join(rows)

    def to_svg(
        self, title: str = "", width: int = 900, row_height: int = 28, predicted_bubble: float | None = None
    ) -> str:
        """A hand-written SVG: one row per rank, one coloured box per span, title (and bubble line) on top."""
        total, origin = self.total_time or 1.0, self.start
        if predicted_bubble is not None:
            title = f"{title}  {self.bubble_line(predicted_bubble)}".strip()
        left, top = 60, 40
        height = top + row_height * self.num_ranks + 30
        scale = (width - left - 10) / total
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="10" y="22" font-size="14">{escape(title)}</text>',
        ]
        for rank in range(self.num_ranks):
            y = top + rank * row_height
            parts.append(f'<text x="8" y="{y + row_height * 0.65:.1f}" font-size="12">rank {rank}</text>')
        for span in self.spans:
            x = left + (span.start - origin) * scale
            w = max((span.end - span.start) * scale, 0.5)
            y = top + span.rank * row_height
            parts.append(
                f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row_height - 4}" '
                f'fill="{COLORS[span.kind]}" stroke="white" stroke-width="0.5">'
                f"<title>{escape(span.label)}</title></rect>"
            )
            label = self.label(span) if span.kind not in COMMUNICATION else ""
            if label and w >= 7 * len(label):
                parts.append(
                    f'<text x="{x + w / 2:.2f}" y="{y + row_height * 0.65:.1f}" font-size="11" fill="white" '
                    f'text-anchor="middle">{escape(label)}</text>'
                )
        legend_y = top + row_height * self.num_ranks + 20
        legend = (("F", "forward"), ("B", "backward"), ("W", "weight grad"), ("X", "p2p post"), ("R", "p2p wait"))
        for i, (kind, name) in enumerate(legend):
            x = left + i * 120
            parts.append(f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{COLORS[kind]}"/>')
            parts.append(f'<text x="{x + 16}" y="{legend_y}" font-size="12">{name}</text>')
        parts.append("</svg>")
        return "\n".join(parts)
