"""A machine profile: how fast one process multiplies, streams memory and runs each collective.

Measured on the machine itself (``polyshard plan --calibrate``, :mod:`calibrate`) and saved as
JSON, or taken by name from :data:`BUILTIN`, built from vendor figures. Every table is kept per
number of processes running at once on a node (key ``k``): on a CPU they share the cores, so a
4-process layout computes and communicates slower per process than a 2-process one; a GPU profile
has one key, since each process has its own device. The tables:

* ``matmul_tflops[k][h]``: TFLOP/s of the products a transformer block of width h runs (a linear
  layer's forward, input gradient and weight gradient on 1024 tokens, h -> 4h), looked up
  (log-interpolated) at a layer's width;
* ``elementwise_gbps[k][h]`` and ``block_overhead_s[k][h]``: a block's work besides its matmuls
  (norms, activations, attention's softmax, residuals, the autograd engine and Python themselves),
  measured on a real block's forward and backward at two batch sizes minus its matmuls, as a fixed
  cost per block and microbatch plus its saved bytes at this rate;
* ``memory_gbps[k]`` and ``optimizer_tensor_s[k]``: an AdamW step streams 28 bytes per parameter
  at that rate, plus a fixed cost per tensor;
* ``collectives[k][op][placement][n]``: ``time = latency + bytes x bus factor / bus bandwidth``
  (nccl-tests' definitions, :func:`polyshard.collectives.ledger.bus_factor`) for a group of n ranks
  inside a node (``intra``) or across nodes (``inter``); an unmeasured n takes the nearest one's
  bandwidth, and its latency grows with the ring's n - 1 steps.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from polyshard.trainer.errors import ConfigError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")

T = TypeVar("T")


@dataclass(frozen=True)
class Link:
    latency_s: float
    """Seconds of a call that moves nothing (fitted intercept)."""
    busbw_gbps: float
    """Bus bandwidth, GB/s (1e9 bytes per second)."""


Collectives = dict[str, dict[str, dict[int, Link]]]
"""op -> "intra" or "inter" -> group size -> link."""


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    """Where the figures come from: "measured on HOST at DATE", or the vendor documents."""
    matmul_tflops: dict[int, dict[int, float]]
    elementwise_gbps: dict[int, dict[int, float]]
    block_overhead_s: dict[int, dict[int, float]]
    memory_gbps: dict[int, float]
    optimizer_tensor_s: dict[int, float]
    collectives: dict[int, Collectives]
    memory_gb: float = 0.0
    """Memory per device, GB: the plan's default for --memory-gb (0: unknown)."""
    devices_per_node: int = 1
    overlap: float = 0.0
    """Share of the data-parallel gradient reduction (and ZeRO-3's gathers) hidden behind backward:
    1 where communication runs on its own engine (NCCL on GPUs), 0 where it shares the cores (gloo)."""
    notes: list[str] = field(default_factory=list)

    def matmul_flops(self, width: float, processes: int = 1) -> float:
        return interpolate(_nearest(self.matmul_tflops, processes), width) * 1e12

    def elementwise_bandwidth(self, width: float, processes: int = 1) -> float:
        return interpolate(_nearest(self.elementwise_gbps, processes), width) * 1e9

    def block_overhead(self, width: float, processes: int = 1) -> float:
        return interpolate(_nearest(self.block_overhead_s, processes), width)

    def optimizer_s(self, elements: float, tensors: int, processes: int = 1, bytes_per_element: int = 28) -> float:
        """Seconds of an AdamW step over ``elements`` parameters in ``tensors`` tensors (28 bytes each:
        p, grad, m, v read; p, m, v written), or of another pass over them moving ``bytes_per_element``."""
        bandwidth = _nearest(self.memory_gbps, processes) * 1e9
        return bytes_per_element * elements / bandwidth + tensors * _nearest(self.optimizer_tensor_s, processes)

    def collective_s(
        self, op: str, group: int, nbytes: float, bus_factor: float, *, inter: bool = False, processes: int = 1
    ) -> float:
        """Seconds for one call of ``op`` on ``group`` ranks moving a buffer of ``nbytes``."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        placements = _nearest(self.collectives, processes)[op]
        table = placements["inter" if inter and "inter" in placements else "intra"]
        known = min(table, key=lambda n: (abs(math.log2(n) - math.log2(group)), n))
        link = table[known]
        latency = link.latency_s * (group - 1) / max(known - 1, 1)
        return latency + nbytes * bus_factor / (link.busbw_gbps * 1e9)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        raw = json.loads(text)
        return cls(
            name=str(raw["name"]),
            source=str(raw["source"]),
            matmul_tflops=_keyed(raw["matmul_tflops"], lambda t: _keyed(t, float)),
            elementwise_gbps=_keyed(raw["elementwise_gbps"], lambda t: _keyed(t, float)),
            block_overhead_s=_keyed(raw["block_overhead_s"], lambda t: _keyed(t, float)),
            memory_gbps=_keyed(raw["memory_gbps"], float),
            optimizer_tensor_s=_keyed(raw["optimizer_tensor_s"], float),
            collectives=_keyed(
                raw["collectives"],
                lambda ops: {
                    op: {where: _keyed(sizes, lambda link: Link(**link)) for where, sizes in placements.items()}
                    for op, placements in ops.items()
                },
            ),
            memory_gb=float(raw.get("memory_gb", 0.0)),
            devices_per_node=int(raw.get("devices_per_node", 1)),
            overlap=float(raw.get("overlap", 0.0)),
            notes=[str(n) for n in raw.get("notes", [])],
        )


def _keyed(raw: dict[str, Any], value: Callable[[Any], T]) -> dict[int, T]:
    """JSON object keys back to ints; a missing or empty table is an error."""
    if not raw:
        raise ValueError("an empty table")
    return {int(k): value(v) for k, v in raw.items()}


def _nearest(table: Mapping[int, T], key: float) -> T:
    best = min(table, key=lambda k: (abs(math.log2(max(k, 1)) - math.log2(max(key, 1))), k))
    return table[best]


def interpolate(table: dict[int, float], x: float) -> float:
    """``table`` at ``x``, linear in log(x) between measured keys, flat beyond them."""
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    if x >= keys[-1]:
        return table[keys[-1]]
    i = bisect.bisect_left(keys, x)
    lo, hi = keys[i - 1], keys[i]
    w = math.log(x / lo) / math.log(hi / lo)
    return table[lo] * (1 - w) + table[hi] * w


def _gpu(
    tflops: float, hbm_gbps: float, memory_gb: float, nvlink_gbps: float, nic_gbps: float, matmul_fraction: float
) -> dict[str, Any]:
    links = {"intra": {8: Link(10e-6, 0.8 * nvlink_gbps)}, "inter": {8: Link(20e-6, 0.8 * nic_gbps)}}
    return {
        "source": "vendor figures (NVIDIA datasheets), derated as the notes say",
        "matmul_tflops": {1: {4096: matmul_fraction * tflops}},
        "elementwise_gbps": {1: {4096: 0.8 * hbm_gbps / 8}},
        "block_overhead_s": {1: {4096: 300e-6}},
        "memory_gbps": {1: 0.8 * hbm_gbps},
        "optimizer_tensor_s": {1: 10e-6},
        "collectives": {1: {op: links for op in OPS}},
        "memory_gb": memory_gb,
        "devices_per_node": 8,
        "overlap": 1.0,
        "notes": [
            f"matmul: {matmul_fraction:.1%} of the dense BF16 peak, fitted on published runs "
            "(polyshard.planner.calibrate_published; the table in published_runs.toml)",
            "elementwise: 8 passes over each saved byte at 80% of the HBM bandwidth, and 0.3 ms of launches and "
            "Python per block forward and backward (assumptions)",
            "collectives: bus bandwidth 80% of the per-direction link rate; latency 10 us inside a node (NVLink), "
            "20 us across (InfiniBand), growing with ring steps (assumptions, not vendor figures)",
        ],
    }


# Vendor figures: H100 SXM5 989 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s; H200 SXM the same compute,
# 141 GB HBM3e at 4.8 TB/s; both NVLink 4 at 900 GB/s per GPU (450 each way) in 8-GPU HGX nodes with one
# ConnectX-7 NDR InfiniBand port per GPU (400 Gb/s = 50 GB/s each way). A100 SXM 80GB: 312 TFLOP/s BF16,
# HBM2e at 2.04 TB/s, NVLink 3 at 600 GB/s (300 each way), one HDR port per GPU (200 Gb/s = 25 GB/s).
# h100-96gb is the H100 of Meta's Grand Teton hosts that torchtitan's published benchmarks ran on
# (torchtitan benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e at 2.4 TB/s, capped at 500 W, the
# same NVLink and 400 Gb/s a GPU; its dense peak is "between SXM and NVL" (835-989), not published, so its
# fraction is of the SXM's 989, as torchtitan's own MFU figure is, and the fit absorbs the lower clock.
PEAK_TFLOPS = {"h100": 989.0, "h100-96gb": 989.0, "a100": 312.0}
MATMUL_FRACTION = {"h100": 0.799, "h100-96gb": 0.501, "a100": 0.693}
"""Share of the dense BF16 peak the planner's matmuls run at: fitted on the ``fit`` rows of the published runs
(``python -m polyshard.planner.calibrate_published``, 2026-12-07); H200 takes H100's (the same chip)."""
BUILTIN: dict[str, Profile] = {
    "h100-nvlink-ib": Profile(
        name="h100-nvlink-ib", **_gpu(PEAK_TFLOPS["h100"], 3350.0, 80.0, 450.0, 50.0, MATMUL_FRACTION["h100"])
    ),
    "h200-nvlink-ib": Profile(
        name="h200-nvlink-ib", **_gpu(PEAK_TFLOPS["h100"], 4800.0, 141.0, 450.0, 50.0, MATMUL_FRACTION["h100"])
    ),
    "h100-96gb-nvlink-ib": Profile(
        name="h100-96gb-nvlink-ib",
        **_gpu(PEAK_TFLOPS["h100-96gb"], 2400.0, 96.0, 450.0, 50.0, MATMUL_FRACTION["h100-96gb"]),
    ),
    "a100-nvlink-ib": Profile(
        name="a100-nvlink-ib", **_gpu(PEAK_TFLOPS["a100"], 2039.0, 80.0, 300.0, 25.0, MATMUL_FRACTION["a100"])
    ),
}


def load_profile(name_or_path: str | Path) -> Profile:
    """A built-in profile by name, or a JSON file written by ``polyshard plan --calibrate``."""
    if str(name_or_path) in BUILTIN:
        return BUILTIN[str(name_or_path)]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(
            f"profile {str(name_or_path)!r} is neither a built-in ({', '.join(BUILTIN)}) nor a file; "
            "run `polyshard plan --calibrate --out FILE` to measure this machine"
        )
    try:
        return Profile.from_json(path.read_text())
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:  # Recursion: nested too deeply
        raise ConfigError(f"{path}: not a polyshard profile ({type(err).__name__}: {err})") from err
