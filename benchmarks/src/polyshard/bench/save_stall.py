"""Benchmark (not a test): how long training stops for a checkpoint, blocking against asynchronous.

    polyshard bench checkpoint --nproc 2

Trains a GPT of about 100M parameters (GPT-2-small's shape on bytes: hidden 768, 12 blocks; ZeRO-1
over the ranks) for a few steps, saving at two of them, once with ``checkpoint.async_save = false``
and once with ``true``, and times every step as the loop sees it (the step, its metrics and its
save). The stall of a save is the time of the step that saved, and of the step after it (an
asynchronous save's writes share the machine with it), above the median step. Rank 0 prints one
line per mode.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from polyshard.bench.arguments import positive
from polyshard.mesh import Mesh, init_distributed
from polyshard.models import parameter_count
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop.trainer import Trainer

STEPS, SAVE_EVERY = 9, 4


def measure(async_save: bool, folder: Path, shape: argparse.Namespace) -> tuple[float, list[float]]:
    world = dist.get_world_size()
    config = from_dict(
        {
            "model": {
                "hidden": shape.hidden,
                "num_layers": shape.layers,
                "num_heads": shape.heads,
                "context_length": 128,
            },
            "parallel": {"dp": world, "zero_stage": 1 if world > 1 else 0},
            "training": {"steps": STEPS, "global_batch_size": 2 * world},
            "eval": {"every": 0, "sample_tokens": 0},
            "checkpoint": {"every": SAVE_EVERY, "keep": 1, "async_save": async_save},
            "data": {"source": "shakespeare"},
            "logging": {"progress_bar": False},
        }
    )
    trainer = Trainer(config, Mesh(config.parallel.mesh_axes), folder, log=False)
    times = []
    for step in range(1, STEPS + 1):
        dist.barrier()
        start = time.perf_counter()
        trainer.step(step)
        dist.barrier()
        times.append(time.perf_counter() - start)
    trainer.finish()
    return float(parameter_count(config.model)), times


def parser() -> argparse.ArgumentParser:
    """The flags of ``main`` (GPT-2-small's shape by default); ``polyshard bench checkpoint`` passes them."""
    parser = argparse.ArgumentParser(prog="polyshard bench checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=positive, default=768)
    parser.add_argument("--layers", type=positive, default=12)
    parser.add_argument("--heads", type=positive, default=12)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    shape = parser().parse_args(argv)
    init_distributed()
    for async_save in (False, True):
        shared = [tempfile.mkdtemp(prefix="polyshard-save-stall-") if dist.get_rank() == 0 else ""]
        dist.broadcast_object_list(shared, src=0)  # one run folder for every rank
        params, times = measure(async_save, Path(shared[0]), shape)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(shared[0], ignore_errors=True)
        saving = [s - 1 for s in range(SAVE_EVERY, STEPS, SAVE_EVERY)]  # steps that saved (0-based), not the last
        plain = statistics.median(t for i, t in enumerate(times) if i not in saving and i - 1 not in saving and i)
        stalls = [times[i] + times[i + 1] - 2 * plain for i in saving]
        if dist.get_rank() == 0:
            mode = "async   " if async_save else "blocking"
            print(f"{mode} save, {params / 1e6:.0f}M parameters on {dist.get_world_size()} ranks: median step "
                  f"{plain * 1e3:.0f} ms; stall per save (the saving step and the next, above the median) "
                  f"{', '.join(f'{s * 1e3:.0f} ms' for s in stalls)}", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
