"""Benchmark (not a test): the tiny DeepSeek-V3 trained by polyshard on ep2 and ep2 x pp2 against the same
model trained by ``transformers`` on one process; tokens/s per process and their ratio.

    polyshard bench deepseek                                  # one process, ep2, ep2 x pp2
    python -m polyshard.bench.deepseek_speed --layouts ep2 --steps 5

The model is the ``deepseek-v3-tiny`` preset (multi-head latent attention, block 0 dense, blocks 1-2 with 8
routed experts in 2 groups and a shared expert; hidden 64, rows of 64 tokens, vocabulary 256).

- **polyshard**: ``polyshard train`` with the layout's settings on a small synthetic corpus, one thread per
  process (the launcher's ``OMP_NUM_THREADS=1``). Its tokens/s is the median of the trainer's own per-step
  figure in ``metrics.jsonl`` (the global batch's tokens over the step's wall time: data, forward and
  backward over the microbatches, reductions, clipping, AdamW), after ``--warmup`` steps.
- **transformers**: ``DeepseekV3ForCausalLM`` built from the ``config.json`` polyshard would export for the
  same model (nothing downloaded; both parameter counts are printed), on this process with ``--threads``
  threads (1: one core, as each of ours): forward with labels, backward, ``torch.optim.AdamW`` step,
  ``zero_grad``, on random tokens of the same global batch. The median step after the warm-up.

Ratio per process: (polyshard's tokens/s / its processes) / transformers' tokens/s. 1.0 means each of our
processes trains as many tokens a second as transformers' one; parallel layouts pay for their
communication and pipeline bubbles, and on a machine with fewer cores than processes for sharing them.
Not timed on transformers' side: the preset's sequence-wise balance loss (coefficient 1e-4), the selection
bias update after each step, gradient clipping (polyshard's step does all three; they are small).
``--rounds`` repeats everything in turns (transformers, then each layout), so load that comes and goes on
a shared machine falls on every row alike.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

PRESET = "deepseek-v3-tiny"
LAYOUTS: dict[str, dict[str, int]] = {
    "one": {},
    "ep2": {"ep": 2},
    "ep2xpp2": {"ep": 2, "pp": 2, "microbatches": 2},
}


def processes(layout: str) -> int:
    return LAYOUTS[layout].get("ep", 1) * LAYOUTS[layout].get("pp", 1)


def _corpus(folder: Path) -> Path:
    """A few hundred lines of words (bytes are the preset's tokens): enough rows for any batch here."""
    rng = random.Random(0)
    words = "the king queen lord love death night day sweet fair heaven earth sword crown blood".split()
    path = folder / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)))
    return path


def polyshard_rates(layout: str, batch: int, steps: int, warmup: int, folder: Path) -> list[float]:
    """Tokens/s of each step after the warm-up, as the trainer measured them, training on ``layout``."""
    config = folder / "deepseek.toml"
    config.write_text(f'[model]\npreset = "{PRESET}"\n\n[data]\nsource = "{_corpus(folder)}"\n')
    out = folder / layout
    settings = [f"parallel.{axis}={size}" for axis, size in LAYOUTS[layout].items()] + [
        f"training.steps={warmup + steps}",
        f"training.global_batch_size={batch}",
        "eval.every=0",
        "eval.sample_tokens=0",
        "logging.every=1",
        "logging.progress_bar=false",
    ]
    cmd = [sys.executable, "-m", "polyshard.cli.main", "train", str(config), "--out", str(out)]
    cmd += [a for s in settings for a in ("--set", s)]
    result = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [float(r["tokens_per_s"]) for r in records if "tokens_per_s" in r][warmup:]


def transformers_model() -> tuple[Any, int, int]:
    """(transformers' DeepseekV3ForCausalLM of the preset, its parameter count, polyshard's model's)."""
    import transformers

    from polyshard.models import build_model
    from polyshard.trainer.checkpointing.hugging_face import hf_config
    from polyshard.trainer.config import from_dict

    ours = from_dict({"model": {"preset": PRESET}}).model
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config.from_dict(hf_config(ours)))
    count = sum(p.numel() for p in model.parameters())
    return model.train(), count, sum(p.numel() for p in build_model(ours).parameters())


def transformers_rates(model: Any, batch: int, steps: int, warmup: int) -> list[float]:
    """Tokens/s of each step after the warm-up: forward with labels, backward, AdamW, zero_grad."""
    from polyshard.trainer.config import from_dict

    chosen = from_dict({"model": {"preset": PRESET}}).optimizer  # the trainer's lr, betas and weight decay
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=chosen.lr, betas=(chosen.beta1, chosen.beta2), weight_decay=chosen.weight_decay
    )
    length, vocab = model.config.max_position_embeddings, model.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    rates = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()  # transformers shifts the labels itself
        optimizer.step()
        optimizer.zero_grad()
        if step >= warmup:
            rates.append(batch * length / (time.perf_counter() - start))
    return rates


def report(rates: dict[str, list[float]], counts: tuple[int, int]) -> str:
    reference = statistics.median(rates["transformers"])
    lines = [
        f"{'layout':<14} {'processes':>9} {'tokens/s':>10} {'per process':>11} {'ratio/process':>13}",
    ]
    for name, values in rates.items():
        n = 1 if name == "transformers" else processes(name)
        rate = statistics.median(values)
        lines.append(f"{name:<14} {n:>9} {rate:>10.0f} {rate / n:>11.0f} {rate / n / reference:>13.2f}")
    lines.append(f"parameters: transformers {counts[0]:,}, polyshard {counts[1]:,} ({PRESET})")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polyshard bench deepseek", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--layouts", default="one,ep2,ep2xpp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--batch", type=int, default=16, help="rows of 64 tokens per global batch")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    p.add_argument("--rounds", type=int, default=1, help="runs of every row, in turns")
    p.add_argument("--threads", type=int, default=1, help="transformers' CPU threads (ours: one per process)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or not layouts:
        parser().error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    if min(args.batch, args.steps, args.rounds, args.threads) < 1 or args.warmup < 0:
        parser().error("--batch, --steps, --rounds and --threads must be at least 1, --warmup at least 0")
    torch.set_num_threads(args.threads)
    model, theirs, ours = transformers_model()
    rates: dict[str, list[float]] = {"transformers": [], **{name: [] for name in layouts}}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            rates["transformers"] += transformers_rates(model, args.batch, args.steps, args.warmup)
            for name in layouts:
                folder = Path(tmp) / f"round{round_}"
                folder.mkdir(exist_ok=True)
                rates[name] += polyshard_rates(name, args.batch, args.steps, args.warmup, folder)
    print(report(rates, (theirs, ours)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
