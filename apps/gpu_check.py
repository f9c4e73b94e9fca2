"""GPU check (not part of CI): the 124M GPT-2 preset on one GPU, bf16, 50 steps; tokens/s and MFU.

    python apps/gpu_check.py            # needs a CUDA device; H100/H200 dense bf16 peak = 989 TFLOP/s

It runs the same trainer as `polyshard train` (one process, NCCL) and prints
the median tokens/s over the last 40 steps and the MFU against the peak.
"""

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from polyshard.mesh import Mesh, init_distributed
from polyshard.trainer.config import from_dict
from polyshard.trainer.loop import train

PEAK_TFLOPS = 989.0


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("apps/gpu_check.py needs a CUDA GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    init_distributed(rank=0, world_size=1)
    config = from_dict(
        {
            "model": {"preset": "gpt2-124m"},
            "training": {
                "steps": 50,
                "global_batch_size": 16,
                "precision": "bf16",
                "eval_every": 0,
                "sample_tokens": 0,
                "warmup_steps": 5,
            },
            "data": {"source": "shakespeare"},
            "logging": {"progress_bar": False, "peak_tflops": PEAK_TFLOPS},
        }
    )
    out = Path(tempfile.mkdtemp(prefix="polyshard-gpu-"))
    train(config, Mesh({"dp": 1}), out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][10:]
    tokens = statistics.median(r["tokens_per_s"] for r in records)
    mfu = statistics.median(r["mfu"] for r in records)
    print(f"gpt2-124m bf16 on {torch.cuda.get_device_name()}: {tokens:,.0f} tokens/s, MFU {mfu:.1%}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
