"""``polyshard bench plan``: the planner's predicted step times against measured ones, for the tiny GPT.

Six layouts (dp2, tp2, pp2 with 1F1B and with ZB-H1, dp2 x tp2, tp2 x pp2; at most 4 processes) run
real training steps on live worker pools (:class:`polyshard.mesh.pool.WorkerPool`, one thread per
process, gloo). A shared machine's load comes and goes, so the machine is calibrated in the same
rounds: every round measures the profile's figures once (:func:`calibrate.measure_round`) and visits
each layout once (one warm-up step, then ``steps`` timed steps, the slowest rank's time each); every
figure is the median over rounds, and the predictions come from the profile of all the rounds. Then
``--layout auto`` picks a layout for 4 processes with that profile, and it takes turns with the
fastest of the six for as many rounds again. This is a benchmark, not a test: it reports, it does
not assert.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from polyshard.models import output_width, sequence_length
from polyshard.planner.auto import choose
from polyshard.planner.calibrate import Sweep, measure_round, probe_saved_bytes, to_profile
from polyshard.planner.cost import estimate_step
from polyshard.planner.profile import Profile
from polyshard.planner.search import label
from polyshard.trainer.config import Config, ParallelConfig, from_dict

LAYOUTS: dict[str, ParallelConfig] = {
    "dp2": ParallelConfig(dp=2),
    "tp2": ParallelConfig(tp=2),
    "pp2 1f1b": ParallelConfig(pp=2, microbatches=4),
    "pp2 zb-h1": ParallelConfig(pp=2, microbatches=4, schedule="zb-h1"),
    "dp2 x tp2": ParallelConfig(dp=2, tp=2),
    "tp2 x pp2": ParallelConfig(tp=2, pp=2, microbatches=4),
}
"""The tiny GPT's ``parallel`` section in each of the six measured layouts."""


def tiny_gpt(global_batch: int = 16) -> Config:
    return from_dict({"model": {"preset": "tiny"}, "training": {"global_batch_size": global_batch}})


def _time_steps(config: Config, steps: int) -> float:
    """Median seconds per training step of ``config`` on this pool (the slowest rank's, random tokens)."""
    from polyshard.mesh import Mesh
    from polyshard.trainer.engine.parallelize import build_engine
    from polyshard.trainer.loop import train_step

    mesh = Mesh(config.parallel.mesh_axes)
    engine = build_engine(config, mesh)
    generator = torch.Generator().manual_seed(mesh.group_rank(config.parallel.batch_axes))
    per_rank = config.training.global_batch_size // config.parallel.data_ranks
    shape = (per_rank, sequence_length(config.model) + 1)
    tokens = torch.randint(0, output_width(config.model), shape, generator=generator)
    times = []
    for i in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        train_step(engine, tokens[:, :-1], tokens[:, 1:], 1e-3)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i > 0:  # the first step builds buffers and optimizer state
            times.append(float(elapsed))
    return statistics.median(times)


@dataclass
class Row:
    name: str
    config: Config
    """The tiny GPT laid out as this row measures it."""
    predicted_s: float
    measured_s: list[float]

    @property
    def measured(self) -> float:
        return statistics.median(self.measured_s)

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured - 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layout": label(self.config),
            "predicted_s": self.predicted_s,
            "measured_s": self.measured,
            "rounds_s": self.measured_s,
            "error": self.error,
        }


CALIBRATION = Sweep(widths=(64, 256), probe_widths=(64,), sizes=(4 << 10, 64 << 10, 256 << 10, 1 << 20), rounds=1)


def _visit(pools: dict[int, Any], rows: list[Row], steps: int) -> None:
    for row in rows:
        pool = pools[row.config.parallel.world_size]
        row.measured_s.append(pool.run(_time_steps, row.config, steps, timeout_s=600)[0])


def run(
    profile: Profile | None = None,
    *,
    rounds: int = 5,
    steps: int = 3,
    global_batch: int = 16,
    log: Callable[[str], None] = print,
) -> tuple[list[Row], Row, Row, Profile]:
    """(the six layouts, the auto pick for 4 processes, the fastest of the six measured beside it, the
    profile), predicted and measured. With ``profile`` None the machine is calibrated in the rounds."""
    from polyshard.mesh.pool import WorkerPool

    config = tiny_gpt(global_batch)
    six = [Row(name, dataclasses.replace(config, parallel=parallel), 0.0, []) for name, parallel in LAYOUTS.items()]
    pools = {n: WorkerPool(n) for n in (1, 2, 4)}
    try:
        calibration: list[dict[str, Any]] = []
        saved = probe_saved_bytes(CALIBRATION.probe_widths)
        for round_ in range(rounds):
            if profile is None:
                calibration.append(measure_round(pools, CALIBRATION, saved))
            _visit(pools, six, steps)
            log(f"round {round_ + 1}/{rounds}: " + ", ".join(f"{r.name} {r.measured_s[-1]:.3f} s" for r in six))
        profile = profile or to_profile(calibration, log=log)
        for row in six:
            row.predicted_s = estimate_step(row.config, profile).step_s
        best = choose(config, 4, profile).ranked[0]
        log(f"--layout auto on 4 processes picks {label(best.config)} (predicted {best.step_s:.4g} s)")
        fastest = min(six, key=lambda r: r.measured)
        pair = [
            Row(f"auto: {label(best.config)}", best.config, best.step_s, []),
            Row(fastest.name, fastest.config, fastest.predicted_s, []),
        ]
        for _ in range(rounds):
            _visit(pools, pair, steps)
    finally:
        for pool in pools.values():
            pool.close()
    return six, pair[0], pair[1], profile


def report(six: list[Row], auto: Row, beside: Row) -> str:
    """A markdown table, the two rankings, and where the auto pick lands."""
    by_prediction = sorted(six, key=lambda r: r.predicted_s)
    by_measurement = sorted(six, key=lambda r: r.measured)
    lines = [
        "| layout | predicted (s) | measured (s, median) | error | rank predicted | rank measured | rounds (s) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in six:
        rounds = " ".join(f"{t:.3f}" for t in row.measured_s)
        lines.append(
            f"| {row.name} ({label(row.config)}) | {row.predicted_s:.3f} | {row.measured:.3f} | {row.error:+.0%} "
            f"| {by_prediction.index(row) + 1} | {by_measurement.index(row) + 1} | {rounds} |"
        )
    same = [r.name for r in by_prediction] == [r.name for r in by_measurement]
    within = sum(abs(r.error) <= 0.25 for r in six)
    four = min((r for r in six if r.config.parallel.world_size == 4), key=lambda r: r.measured)
    lines += [
        "",
        f"ranking by prediction: {', '.join(r.name for r in by_prediction)}",
        f"ranking by measurement: {', '.join(r.name for r in by_measurement)}",
        f"rankings {'equal' if same else 'differ'}; {within} of {len(six)} predictions within 25%",
        f"--layout auto (4 processes) picks {label(auto.config)} (predicted {auto.predicted_s:.3f} s): measured "
        f"{auto.measured:.3f} s against {beside.measured:.3f} s for the fastest of the six ({beside.name}) in the same "
        f"rounds ({auto.measured / beside.measured - 1:+.0%}); the fastest 4-process layout of the six ({four.name}) "
        f"measured {four.measured:.3f} s",
    ]
    return "\n".join(lines)
