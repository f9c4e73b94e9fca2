"""Benchmark (not a test): ``polyshard prepare``'s throughput against nanoGPT's way of preparing data.

    polyshard bench prepare --mb 64 --workers 1,2

A seeded synthetic English-like corpus (Zipf-distributed pseudo-words in sentences and paragraphs,
``--files`` text files of blank-line-separated paragraphs, ``--mb`` MB in all) is written to a temporary
folder, and a byte-level BPE of ``--vocab-size`` tokens is trained on a sample of it with
:func:`~polyshard.data.tokenizer.train_bpe`. Then, for each worker count N, in the same run:

- ours: ``prepare(corpus, out, tokenizer, split_on="blank", workers=N)``;
- the baseline, nanoGPT's ``data/openwebtext/prepare.py`` pattern with the same tokenizer and the same
  paragraphs: ``datasets.load_dataset("text", sample_by="paragraph")``, ``.map(tokenize, batched=True,
  num_proc=N)`` (each paragraph's ids plus the separator's), then the lengths summed and the ids
  written batch by batch into one ``uint16`` ``np.memmap``.

Both are timed from the text files on disk to the tokens on disk (the baseline's datasets cache is a
fresh folder each time, so nothing is reused). MB/s counts source bytes. The tokenizers library's own
thread pool is switched off (``TOKENIZERS_PARALLELISM=false``) so that N is the number of cores each
side uses; both sides encode with ``encode_batch_fast``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SYLLABLES = (
    "ba be bi bo bu ca ce co da de di do fa fe fi ga ge go ha he hi ho la le li lo ma me mi mo na ne ni no "
    "pa pe pi po ra re ri ro sa se si so ta te ti to va ve vi wa we wi ya yo za ze th sh ch st str an en in on"
).split()


@dataclass(frozen=True)
class Row:
    method: str
    workers: int
    seconds: float
    megabytes: float
    tokens: int

    @property
    def mb_per_s(self) -> float:
        return self.megabytes / self.seconds


def write_corpus(folder: Path, megabytes: float, files: int = 16, seed: int = 0) -> int:
    """``files`` text files of English-like paragraphs separated by blank lines; the bytes written."""
    rng = np.random.default_rng(seed)
    vocabulary = np.array(
        ["".join(rng.choice(_SYLLABLES, size=rng.integers(1, 4))) for _ in range(20_000)], dtype=object
    )
    weights = 1.0 / np.arange(1, len(vocabulary) + 1) ** 1.1  # Zipf: a few words are most of the text
    weights /= weights.sum()
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for number in range(files):
        count = int(megabytes * 1e6 / files / 6.2)  # about 6.2 bytes per word with its space
        words = vocabulary[rng.choice(len(vocabulary), size=count, p=weights)]
        ends = rng.random(count)
        gaps = np.where(ends < 1 / 150, ".\n\n", np.where(ends < 1 / 14, ". ", np.where(ends < 1 / 9, ", ", " ")))
        text = "".join(w + g for w, g in zip(words.tolist(), gaps.tolist())).strip() + ".\n"
        path = folder / f"part-{number:03d}.txt"
        path.write_text(text, encoding="utf-8")
        total += path.stat().st_size
    return total


def ours(corpus: Path, out: Path, tokenizer: Path, workers: int) -> int:
    from polyshard.data.prepare import prepare

    manifest = prepare(corpus, out, tokenizer, split_on="blank", val_fraction=0.0, workers=workers, progress=False)
    return manifest.tokens


_LOADED: dict[str, Any] = {}


def _tokenize(batch: dict[str, list[str]], path: str, end: list[int]) -> dict[str, list[Any]]:
    """The baseline's map function: each paragraph's ids and the separator's (nanoGPT appends its eot)."""
    if path not in _LOADED:
        import tokenizers

        _LOADED[path] = tokenizers.Tokenizer.from_file(path)
    ids = [e.ids + end for e in _LOADED[path].encode_batch_fast(batch["text"])]
    return {"ids": ids, "len": [len(i) for i in ids]}


def baseline(corpus: Path, out: Path, tokenizer: Path, workers: int) -> int:
    """nanoGPT's prepare.py, with load_dataset("text") and our tokenizer: map, sum the lengths, memmap."""
    import datasets
    import tokenizers

    datasets.disable_progress_bars()
    end = tokenizers.Tokenizer.from_file(str(tokenizer)).encode("\n").ids
    cache = out / "cache"
    files = sorted(str(p) for p in corpus.glob("*.txt"))
    split = datasets.load_dataset("text", data_files=files, sample_by="paragraph", split="train", cache_dir=str(cache))
    tokenized = split.map(
        _tokenize, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"],
        fn_kwargs={"path": str(tokenizer), "end": end}, desc=None,
    )  # fmt: skip
    length = int(np.sum(tokenized["len"], dtype=np.uint64))
    array = np.memmap(out / "train.bin", dtype=np.uint16, mode="w+", shape=(length,))
    at, shards = 0, 64
    for index in range(shards):
        batch = tokenized.shard(num_shards=shards, index=index, contiguous=True).with_format("numpy")
        ids = np.concatenate(batch["ids"])
        array[at : at + len(ids)] = ids
        at += len(ids)
    array.flush()
    return length


def run(
    megabytes: float = 64.0,
    workers: Sequence[int] = (1, 2),
    vocab_size: int = 8192,
    files: int = 16,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """The corpus, the tokenizer, then both methods at each worker count; one row per (method, N)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # N processes means N cores on both sides
    from polyshard.data.tokenizer import train_bpe

    rows = []
    with tempfile.TemporaryDirectory(prefix="polyshard-bench-prepare-") as tmp:
        root = Path(tmp)
        size = write_corpus(root / "corpus", megabytes, files)
        log(f"corpus: {size / 1e6:.1f} MB in {files} files; training a {vocab_size}-token BPE on 4 MB of it")
        sample = (root / "corpus" / "part-000.txt").read_text(encoding="utf-8")[: 4 << 20]
        tokenizer = train_bpe([sample], vocab_size, root / "tokenizer.json")
        for count in workers:
            for method, fn in (("polyshard prepare", ours), ("nanoGPT (datasets map + memmap)", baseline)):
                out = root / f"out-{count}"
                out.mkdir()
                start = time.perf_counter()
                tokens = fn(root / "corpus", out / "prepared", tokenizer, count)
                row = Row(method, count, time.perf_counter() - start, size / 1e6, tokens)
                log(f"{method:>32}, {count} workers: {row.seconds:6.1f} s, {row.mb_per_s:5.1f} MB/s, {tokens:,} tokens")
                rows.append(row)
                shutil.rmtree(out)
    return rows


def report(rows: Sequence[Row]) -> str:
    lines = ["| workers | polyshard prepare MB/s | nanoGPT-style MB/s | ratio |", "|---|---|---|---|"]
    for count in sorted({r.workers for r in rows}):
        mine = next(r for r in rows if r.workers == count and r.method.startswith("polyshard"))
        theirs = next(r for r in rows if r.workers == count and not r.method.startswith("polyshard"))
        ratio = mine.mb_per_s / theirs.mb_per_s
        lines.append(f"| {count} | {mine.mb_per_s:.1f} | {theirs.mb_per_s:.1f} | {ratio:.2f}x |")
    return "\n".join(lines)
