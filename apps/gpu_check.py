"""GPU check (not part of CI): GPT-2-124M and Llama-3.2-1B on one NVIDIA GPU, bf16, eager then compiled.

    python apps/gpu_check.py     # from the repository root; nothing to install or download

For a bare machine with one GPU and no network: torch, transformers, safetensors, tokenizers and typer
installed, the polyshard packages read from this source tree. The data is a seeded synthetic corpus
(`synthetic_corpus`) prepared with the byte tokenizer into a temporary folder, so nothing is fetched.
Each run trains through the same `Trainer` as `polyshard train` (one process, NCCL) and prints the
median tokens/s over its steps after the first few (compiling and warm-up), the MFU against the GPU's
datasheet dense bf16 peak, and the peak memory the CUDA allocator held. The whole check takes a few
minutes on an H100/H200 (it prints the time of each run). Compiled runs need `training.compile`; a
build without it says "compile: not available in this build" and runs eager only.

Without a CUDA device it prepares the data, checks every run's config against it, prints
"no CUDA device" and exits with status 77 (what tests/test_gpu_check.py checks on the CPU).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import itertools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("polyshard") is None:  # a source tree, nothing installed: read the packages from it
    sys.path[:0] = [str(src) for src in sorted(ROOT.glob("packages/*/src"))]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from polyshard.data.prepare import prepare  # noqa: E402
from polyshard.mesh import Mesh, init_distributed  # noqa: E402
from polyshard.trainer.config import Config, TrainingConfig, from_dict  # noqa: E402
from polyshard.trainer.data.language import check_language_data  # noqa: E402
from polyshard.trainer.loop import Trainer  # noqa: E402
from polyshard.trainer.loop.hooks import Hook  # noqa: E402
from polyshard.trainer.loop.metrics import model_flops_per_token  # noqa: E402

EXIT_NO_CUDA = 77  # "skipped", as automake's test drivers read it
# Datasheet dense bf16 peaks (TFLOP/s), matched against torch.cuda.get_device_name(); SXM parts (an H100
# PCIe is 756). First match wins, so the longer names come first.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
# (name, model settings, global batch, steps). Llama-3.2-1B keeps its sizes but trains on 2,048-token rows.
RUNS: list[tuple[str, dict[str, Any], int, int]] = [
    ("gpt2-124m", {"preset": "gpt2-124m"}, 16, 30),
    ("llama-3.2-1b", {"preset": "llama-3.2-1b", "context_length": 2048}, 8, 20),
]
WARMUP_STEPS = 5  # left out of the median: compiling, the allocator growing, cuBLAS picking kernels
CORPUS_BYTES = 8 << 20  # 8 MB of text: about 3,700 rows of 2,049 bytes, more than any run reads


def synthetic_corpus(path: Path, size: int, seed: int = 0) -> None:
    """About ``size`` bytes of seeded English-like text: words drawn with Zipf-like weights, 100 to a
    paragraph, paragraphs separated by blank lines (so the prepared data has documents to hold out)."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices("etaoinshrdlucmfwypvbgkqjxz", k=rng.randint(1, 9))) for _ in range(5000)]
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(vocabulary))))
    words = rng.choices(vocabulary, cum_weights=cumulative, k=size // 6)  # about 6 bytes a word, with its space
    paragraphs = (" ".join(words[i : i + 100]) + "." for i in range(0, len(words), 100))
    path.write_text("\n\n".join(paragraphs) + "\n")


def has_compile() -> bool:
    return "compile" in {f.name for f in dataclasses.fields(TrainingConfig)}


def run_config(model: dict[str, Any], batch: int, steps: int, data: Path, compiled: bool) -> Config:
    training = {"steps": steps + 1, "global_batch_size": batch, "precision": "bf16"}
    training |= {"compile": True} if compiled else {}
    return from_dict(
        {"model": model, "training": training, "lr_schedule": {"warmup_steps": 2},
         "eval": {"every": 0, "sample_tokens": 0}, "data": {"source": str(data)}, "logging": {"progress_bar": False}}
    )  # fmt: skip


class StepTimes(Hook):
    """Each step's seconds (as the trainer measured them for its tokens/s) and loss."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.losses: list[float] = []

    def after_step(self, step: int, seconds: float, record: dict[str, Any]) -> None:
        self.seconds.append(seconds)
        self.losses.append(record["loss"])


def measure(name: str, config: Config, steps: int, out: Path, peak_tflops: float | None) -> str:
    gc.collect()  # the previous run's model and optimizer
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    started, times = time.perf_counter(), StepTimes()
    trainer = Trainer(config, Mesh({"dp": 1}), out, log=False, hooks=[times])
    # One step short of training.steps: the trainer saves at the last step, and a 1B model's checkpoint
    # (weights and AdamW moments, about 15 GB) would take longer to write than the run takes to train.
    for step in range(1, steps + 1):
        trainer.step(step)
    model, tokens_per_step = config.model, config.training.global_batch_size * config.model.context_length
    tokens_per_s = tokens_per_step / statistics.median(times.seconds[WARMUP_STEPS:])
    flops = tokens_per_s * model_flops_per_token(model)
    mfu = f"MFU {flops / (peak_tflops * 1e12):.1%}" if peak_tflops else "MFU n/a (unknown GPU)"
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    return (
        f"{name}: {tokens_per_s:,.0f} tokens/s, {mfu}, peak memory {peak_gib:.1f} GiB, loss "
        f"{times.losses[0]:.2f} -> {times.losses[-1]:.2f}, first step {times.seconds[0]:.1f} s, "
        f"run {time.perf_counter() - started:.0f} s"
    )


def main(work: Path) -> int:
    synthetic_corpus(work / "corpus.txt", CORPUS_BYTES)
    data = work / "prepared"
    prepare(work / "corpus.txt", data, "bytes", split_on="blank", val_fraction=0.05, workers=1, progress=False)
    compiled = [False, True] if has_compile() else [False]
    plan = [
        (f"{name} {'compiled' if c else 'eager'}", run_config(model, batch, steps, data, c), steps)
        for name, model, batch, steps in RUNS
        for c in compiled
    ]
    for _, config, _ in plan:
        check_language_data(config)  # every run finds enough rows, before any GPU time is spent
    if not has_compile():
        print("compile: not available in this build (no training.compile); eager runs only")
    if not torch.cuda.is_available():
        print(f"no CUDA device: data prepared ({CORPUS_BYTES >> 20} MB of text), {len(plan)} runs configured; stopping")
        return EXIT_NO_CUDA
    device = torch.cuda.get_device_name()
    peak = next((tflops for key, tflops in PEAK_TFLOPS.items() if key in device), None)
    print(f"{device}, torch {torch.__version__}, bf16 peak {peak or 'unknown'} TFLOP/s", flush=True)
    init_distributed(store=dist.HashStore(), rank=0, world_size=1)  # NCCL, this process alone, no ports
    for name, config, steps in plan:
        print(measure(name, config, steps, work / name.replace(" ", "-"), peak), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="polyshard-gpu-check-") as folder:
        status = main(Path(folder))
    sys.exit(status)
