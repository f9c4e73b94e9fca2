"""Model FLOPs utilisation: the model's FLOPs per second on each rank against what one rank can do.

    achieved_tflops_per_rank = model_flops_per_token x tokens per step / step seconds / world size
    mfu                      = achieved_tflops_per_rank / peak_tflops

model_flops_per_token is :func:`polyshard.models.flops.flops_per_token`, the count the planner's step time
uses too: 6N for the matmuls' forward and backward (N the matmul weights a token passes through: an MoE's
active experts, no embedding tables) plus attention's scores and weighted sums at the heads' own widths
(MLA's, and sliding windows'), causal attention's masked half left out (PaLM appendix B's 6N + 12·L·H·S
otherwise); recomputation is not counted (that would be hardware FLOPs utilisation).

The peak, per process, is the first of:

1. ``logging.peak_tflops``, when set;
2. on CUDA, the GPU's datasheet dense peak for the run's precision (:data:`DATASHEET`, by device name);
3. on CPU, for a float32 run, the best matmul rate of ``polyshard plan --calibrate``'s profile
   (:data:`CALIBRATION`) at the number of processes sharing this machine;
4. a quick measurement at startup: a 1024² matmul in the run's dtype, repeated for ~0.2 s, best rate.
   Every rank measures at once, so on a CPU whose cores the ranks share each measures the rate it gets
   while the others work, as in training (rank 0 alone would see the whole machine and overstate each
   rank's peak); the ranks' mean is broadcast back so every rank logs the same peak.

``peak_source`` names which one was used.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

CALIBRATION = Path.home() / ".cache" / "polyshard" / "profile.json"
"""Where ``polyshard plan --calibrate`` writes this machine's profile by default."""

DATASHEET: dict[str, dict[str, float]] = {
    # dense TFLOP/s (no sparsity): bf16 tensor cores; fp32 without TF32 (torch's default for matmuls)
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},  # SXM (HBM3); checked after the PCIe name
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp32": 30.3},
}
"""NVIDIA datasheet peaks by a part of ``torch.cuda.get_device_name()``, first match wins."""


@dataclass(frozen=True)
class Peak:
    tflops: float
    """Peak TFLOP/s of one process."""
    source: str
    """Where it came from: the config, a datasheet, a calibration profile, or measured at startup."""


def datasheet_peak(device_name: str, precision: str) -> float | None:
    for part, peaks in DATASHEET.items():
        if part in device_name:
            return peaks[precision]
    return None


def calibrated_peak(path: Path, processes: int) -> float | None:
    """The best matmul TFLOP/s the profile at ``path`` measured with the number of processes nearest
    ``processes``; None when there is no readable profile."""
    try:
        tables = json.loads(path.read_text())["matmul_tflops"]
        nearest = min(tables, key=lambda k: abs(int(k) - processes))
        return max(float(rate) for rate in tables[nearest].values())
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deeply
        return None


def measure_peak(device: torch.device, dtype: torch.dtype, budget_s: float = 0.2, size: int = 1024) -> float:
    """This process's best TFLOP/s on a ``size``² matmul over about ``budget_s`` seconds."""
    # Constant operands: drawing random ones would move the global generator, and with it dropout.
    a = torch.full((size, size), 0.5, device=device, dtype=dtype)
    b = torch.full((size, size), 0.25, device=device, dtype=dtype)
    best, start = float("inf"), time.perf_counter()
    for i in range(1000):
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is a warm-up
            best = min(best, time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() - start > budget_s:
            break
    return 2 * size**3 / best / 1e12


def resolve_peak(configured: float | None, precision: str, device: torch.device) -> Peak:
    """The peak per process (see the module docstring); collective when it has to measure."""
    if configured:
        return Peak(configured, "logging.peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sheet = datasheet_peak(name, precision)
        if sheet is not None:
            return Peak(sheet, f"datasheet: {name}, {precision} dense")
    elif precision == "fp32":
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        calibrated = calibrated_peak(CALIBRATION, processes)
        if calibrated is not None:
            sharing = f"{processes} processes" if processes > 1 else "1 process"
            return Peak(calibrated, f"calibration: {CALIBRATION} ({sharing})")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    dist.barrier()  # every rank starts together, sharing the machine as in training
    rate = torch.tensor([measure_peak(device, dtype)], dtype=torch.float64, device=device)
    dist.all_reduce(rate)
    source = f"measured at startup: 1024² {precision} matmul, every rank at once"
    return Peak(float(rate) / dist.get_world_size(), source)


class Utilisation:
    """Per step: the record's MFU fields; at the end, medians for the run's summary."""

    def __init__(self, flops_per_token: float, tokens_per_step: int, world_size: int, peak: Peak | None):
        self.flops_per_token, self.tokens_per_step, self.peak = flops_per_token, tokens_per_step, peak
        self.world_size = world_size
        self.seconds: list[float] = []

    def fields(self, seconds: float) -> dict[str, float | str]:
        self.seconds.append(seconds)
        return self._fields(seconds)

    def _fields(self, seconds: float) -> dict[str, float | str]:
        achieved = self.flops_per_token * self.tokens_per_step / seconds / self.world_size / 1e12
        out: dict[str, float | str] = {"model_flops_per_token": self.flops_per_token}
        out["achieved_tflops_per_rank"] = achieved
        if self.peak is not None:
            out.update(mfu=achieved / self.peak.tflops, peak_tflops=self.peak.tflops, peak_source=self.peak.source)
        return out

    def summary(self) -> dict[str, float | str]:
        """The run's median step (the first step, which warms up, left out when there are others)."""
        if not self.seconds:
            return {}
        seconds = statistics.median(self.seconds[1:] or self.seconds)
        return {"tokens_per_s": self.tokens_per_step / seconds, **self._fields(seconds)}
