"""Fit a built-in profile's achieved matmul fraction on the published runs marked ``fit``.

``python -m polyshard.planner.calibrate_published`` prints, per GPU kind, the fraction of the dense
bf16 peak that makes the planner's mean (log) error over that kind's ``fit`` rows zero, kept inside
what large GEMMs reach on that GPU (:data:`BOUNDS`), and each row's error at it. The value goes into
:data:`polyshard.planner.profile.MATMUL_FRACTION` by hand, with the date; ``check`` rows are not used.

One constant is fitted, not several: the table has a handful of rows per GPU kind, and the collective
bandwidths and per-block costs the rows would also pull on stay the vendor-derived ones (a fit of
five constants to five rows would reproduce them and predict nothing).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from polyshard.planner.profile import BUILTIN, PEAK_TFLOPS, Profile
from polyshard.planner.published import PublishedRun, load_runs, predict

BOUNDS = {"h100": (0.5, 0.8), "h100-96gb": (0.5, 0.8), "a100": (0.5, 0.9)}
"""Fractions of the dense bf16 peak a large bf16 GEMM reaches (cuBLAS: about 750-800 of H100 SXM's 989
TFLOP/s, 270-280 of A100's 312): a fit outside them would hide another cost in the matmul rate. The 500 W
H100 of h100-96gb has the same upper bound (its own peak is lower, not higher)."""


def with_matmul_fraction(profile: Profile, gpu: str, fraction: float) -> Profile:
    """``profile`` with every width's matmul rate at ``fraction`` of the GPU's dense bf16 peak."""
    rate = {width: fraction * PEAK_TFLOPS[gpu] for width in _widths(profile)}
    return dataclasses.replace(profile, matmul_tflops={k: dict(rate) for k in profile.matmul_tflops})


def _widths(profile: Profile) -> set[int]:
    return {width for table in profile.matmul_tflops.values() for width in table}


def mean_log_error(runs: list[PublishedRun], profile: Profile) -> float:
    """Mean of log(predicted step / published step) over ``runs``: 0 when they balance."""
    return sum(math.log(predict(run, profile).step_s / run.published_step_s()) for run in runs) / len(runs)


def fit_fraction(
    runs: list[PublishedRun], gpu: str, rounds: int = 8, log: Callable[[str], None] | None = None
) -> float:
    """The matmul fraction (inside :data:`BOUNDS`) whose mean log error over ``runs`` is nearest 0, by
    bisection: a higher rate only shortens a step, so the error falls as the fraction grows."""
    low, high = BOUNDS[gpu]
    base = BUILTIN[f"{gpu}-nvlink-ib"]
    for _ in range(rounds):
        middle = (low + high) / 2
        error = mean_log_error(runs, with_matmul_fraction(base, gpu, middle))
        if log:
            log(f"{gpu}: fraction {middle:.4f} -> mean error {math.expm1(error):+.1%}")
        low, high = (middle, high) if error > 0 else (low, middle)
    return round((low + high) / 2, 3)


def main() -> None:
    runs = load_runs()
    for gpu in BOUNDS:
        fitted = [run for run in runs if run.gpu == gpu and run.role == "fit"]
        fraction = fit_fraction(fitted, gpu, log=print)
        profile = with_matmul_fraction(BUILTIN[f"{gpu}-nvlink-ib"], gpu, fraction)
        print(f"{gpu}: fitted matmul fraction {fraction} on {', '.join(run.name for run in fitted)}")
        for run in runs:
            if run.gpu == gpu and run.role != "unmodeled":
                error = predict(run, profile).step_s / run.published_step_s() - 1
                print(f"  {run.role:5s} {run.name:28s} {error:+.1%}")


if __name__ == "__main__":
    main()
