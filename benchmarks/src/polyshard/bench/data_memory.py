"""Benchmark (not a test): the memory and startup a run's data costs, against the corpus's size.

    polyshard bench data --sizes-mb 1,50,2048 --ranks 2,8

For each size it writes a seeded synthetic corpus on disk (English-like words, documents separated by
blank lines), prepares it with the byte tokenizer (``polyshard prepare --split-on blank``), and trains
a small GPT for a few steps with ``polyshard train`` on each number of ranks (all data-parallel), as a
user would. From the run's ``metrics.jsonl`` it reads every rank's peak resident memory, and it times
launch to the first step (the first metrics line). The data-related memory per rank is the peak above
the same run on the smallest corpus. It also shows what the training order costs per rank at 10^9
windows (:class:`~polyshard.data.order.Permutation`) beside an index array of that many windows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyshard.bench.arguments import positive

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no will more some what up out them into time "
    "king queen lord love death night day sweet fair heaven earth sword crown blood river stone house field morning"
).split()


def write_corpus(path: Path, megabytes: float, seed: int = 0, doc_lines: int = 40) -> int:
    """A text file of about ``megabytes`` MB: lines of random words, a blank line every ``doc_lines`` lines
    (one document per block). Written in blocks; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    pool = [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 16)))).encode() for _ in range(20_000)]
    target, written = int(megabytes * 1e6), 0
    with open(path, "wb") as out:
        while written < target:
            picks = rng.integers(0, len(pool), size=200_000)
            lines = [pool[i] for i in picks]
            for cut in range(doc_lines, len(lines), doc_lines):
                lines[cut] = b""  # an empty line ends a document
            block = b"\n".join(lines)[: target - written] + b"\n"
            out.write(block)
            written += len(block)
    return written


def order_memory(windows: int = 10**9, batch: int = 1024) -> tuple[int, int]:
    """(bytes traced while computing one global batch of the order over ``windows``, the bytes an int64
    index of every window would take)."""
    from polyshard.data.order import Permutation

    tracemalloc.start()
    Permutation(windows, seed=0, epoch=3)[np.arange(windows - batch, windows)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, windows * 8


@dataclass
class Run:
    megabytes: float
    ranks: int
    peak_rss: list[int]
    first_step_s: float
    wall_s: float


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "polyshard.cli.main", *args]


def train(prepared: Path, out: Path, ranks: int, steps: int, force: bool = False) -> Run:
    settings = [
        "model.hidden=64", "model.num_layers=2", "model.num_heads=4", "model.context_length=128",
        f"data.source={prepared}", f"parallel.dp={ranks}", f"training.steps={steps}",
        f"training.global_batch_size={8 * ranks}", "eval.every=0", "eval.sample_tokens=0",
        "logging.progress_bar=false",
    ]  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)  # a fresh run folder: its first metrics line is this run's
    config = out.with_suffix(".toml")
    config.write_text("# polyshard bench data: every setting is a --set below\n")
    cmd = _cli(
        "train", str(config), "--out", str(out), "--nproc", str(ranks), *[a for s in settings for a in ("--set", s)]
    ) + (["--force"] if force else [])
    start = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, first = out / "metrics.jsonl", None
    while process.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size:
            first = time.perf_counter() - start
        time.sleep(0.05)
    wall = time.perf_counter() - start
    if process.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({process.returncode}):\n{process.stderr.read()[-3000:]}")  # type: ignore[union-attr]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    peaks = max((r["peak_memory_bytes_per_rank"] for r in records if "peak_memory_bytes_per_rank" in r), key=max)
    return Run(0.0, ranks, peaks, first if first is not None else wall, wall)


def run(
    sizes_mb: Sequence[float],
    ranks: Sequence[int],
    steps: int,
    folder: Path,
    log: Callable[[str], None],
    force: bool = False,
) -> list[Run]:
    runs = []
    for size in sorted(sizes_mb):
        corpus, prepared = folder / f"corpus-{size:g}mb.txt", folder / f"prepared-{size:g}mb"
        if not prepared.exists():
            log(f"writing a {size:g} MB corpus ...")
            write_corpus(corpus, size)
            start = time.perf_counter()
            subprocess.run(
                _cli("prepare", str(corpus), str(prepared), "--tokenizer", "bytes", "--split-on", "blank", "--quiet"),
                check=True,
            )
            log(f"  prepared in {time.perf_counter() - start:.1f} s ({size / (time.perf_counter() - start):.0f} MB/s)")
            corpus.unlink()  # the prepared folder is what the runs read
        for n in ranks:
            result = train(prepared, folder / f"run-{size:g}mb-{n}", n, steps, force)
            result.megabytes = size
            log(f"  {size:g} MB on {n} ranks: peak RSS per rank up to {max(result.peak_rss) / 2**20:.0f} MiB, "
                f"first step after {result.first_step_s:.1f} s")  # fmt: skip
            runs.append(result)
    return runs


def report(runs: list[Run]) -> str:
    smallest = min(r.megabytes for r in runs)
    base = {r.ranks: max(r.peak_rss) for r in runs if r.megabytes == smallest}
    first = {r.ranks: r.first_step_s for r in runs if r.megabytes == smallest}
    lines = [
        f"| corpus | ranks | peak RSS per rank (max) | data-related per rank (above {smallest:g} MB) "
        "| launch to first step | vs smallest |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        peak = max(r.peak_rss)
        lines.append(
            f"| {r.megabytes:g} MB | {r.ranks} | {peak / 2**20:.0f} MiB | {(peak - base[r.ranks]) / 2**20:+.0f} MiB "
            f"| {r.first_step_s:.1f} s | x{r.first_step_s / first[r.ranks]:.2f} |"
        )
    traced, index = order_memory()
    lines.append("")
    lines.append(
        f"The order over 10^9 windows: {traced / 2**10:.0f} KiB traced while computing one global batch of 1024 "
        f"(an int64 index of every window: {index / 2**30:.1f} GiB per rank)."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 50, 2048])
    parser.add_argument("--ranks", type=positive, nargs="+", default=[2, 8])
    parser.add_argument("--steps", type=positive, default=5)
    parser.add_argument("--folder", type=Path, default=None, help="keep corpora and runs here (default: a temp folder)")
    parser.add_argument("--force", action="store_true", help="train on more ranks than this machine holds")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.folder is not None:
        args.folder.mkdir(parents=True, exist_ok=True)
        runs = run(args.sizes_mb, args.ranks, args.steps, args.folder, print, args.force)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            runs = run(args.sizes_mb, args.ranks, args.steps, Path(tmp), print, args.force)
    print(report(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
