"""Text data: bytes as tokens, packed into fixed-length sequences, through ``datasets``.

Sources: ``"shakespeare"`` (built in), a local ``.txt`` file or a folder of
them, or any dataset name ``datasets.load_dataset`` knows (when online; it
must have a ``text`` column). The byte-level tokenizer maps each UTF-8 byte to
a token in [0, 256). The token stream is cut into examples of
``context_length + 1`` tokens (inputs and shifted targets); the last
``val_fraction`` of the examples is the validation split.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import datasets
import numpy as np

from polyshard.trainer.data.corpus import shakespeare_files
from polyshard.data.tokenizer import BYTES, ByteTokenizer, load_tokenizer
from polyshard.trainer.errors import DataError

VOCAB_SIZE = ByteTokenizer.vocab_size  # one byte, one token


def encode(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


def decode(tokens: Sequence[int]) -> str:
    """Bytes back to text; a token past the byte range (a larger vocabulary) shows as U+FFFD."""
    return ByteTokenizer().decode(tokens)


def _raw_text(source: str) -> datasets.Dataset:
    if source == "shakespeare":
        files = [str(p) for p in shakespeare_files()]
    elif Path(source).exists():
        path = Path(source)
        files = [str(p) for p in sorted(path.glob("*.txt"))] if path.is_dir() else [str(path)]
        if not files:
            raise DataError(f"{source} is a folder with no .txt files")
    else:
        try:
            ds = datasets.load_dataset(source, split="train")
        except Exception as err:  # the library raises many kinds; the message says what to do
            raise DataError(
                f"data.source={source!r} is neither 'shakespeare', a local file or folder, nor a dataset that "
                f"could be loaded ({type(err).__name__}: {err})"
            ) from err
        if "text" not in ds.column_names:
            raise DataError(f"dataset {source!r} has no 'text' column (it has {ds.column_names})")
        return ds.select_columns(["text"])
    return datasets.load_dataset("text", data_files=files, split="train", sample_by="document")


def local_files(source: str) -> list[Path] | None:
    """The text files a built-in or local source reads; None for a dataset name (checked when loaded)."""
    if source == "shakespeare":
        return shakespeare_files()
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise DataError(f"data.source={source!r} is a folder with no .txt files")
        return files
    if path.exists():
        return [path]
    if "/" in source and not path.parent.exists() or source.endswith(".txt"):
        raise DataError(f"data.source={source!r}: no such file or folder; give 'shakespeare', a .txt file or folder")
    return None


def check_text_source(
    source: str, context_length: int, val_fraction: float, global_batch: int, vocab_size: int, tokenizer: str = BYTES
) -> None:
    """Before any process starts: a local source must exist, its tokens must lie in the model's
    vocabulary, and (for bytes) it must hold at least one global batch of ``context_length + 1``-token
    examples in each split (the counts :func:`packed_splits` will make)."""
    files = local_files(source)
    if tokenizer != BYTES:
        size = load_tokenizer(tokenizer).vocab_size
        if size > vocab_size:
            raise DataError(
                f"data.tokenizer={tokenizer!r} has {size} tokens, more than model.vocab_size={vocab_size}; "
                f"use vocab_size >= {size}"
            )
        return  # token counts need the whole text tokenized: the workers check them
    if files is None:
        return
    if vocab_size < VOCAB_SIZE:  # a small vocabulary fits only data whose bytes stay below it
        top = max((int(np.fromfile(f, dtype=np.uint8).max(initial=0)) for f in files), default=0)
        if top >= vocab_size:
            raise DataError(
                f"data.source={source!r} holds byte {top}, past model.vocab_size={vocab_size}; "
                f"use vocab_size >= {top + 1} ({VOCAB_SIZE} fits any text)"
            )
    tokens = sum(f.stat().st_size for f in files) + len(files) - 1  # documents joined by newlines
    count = tokens // (context_length + 1)
    num_val = max(1, int(round(count * val_fraction)))
    for split, examples in (("training", count - num_val), ("validation", num_val)):
        if examples < global_batch:
            raise DataError(
                f"data.source={source!r} holds {tokens} tokens: {examples} {split} examples of "
                f"model.context_length+1={context_length + 1} tokens, fewer than one global batch of {global_batch}; "
                f"use a shorter context, a smaller training.global_batch_size or more data"
            )


def packed_splits(
    source: str, context_length: int, val_fraction: float, tokenizer: str = BYTES
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, validation) datasets of ``tokens`` rows, each ``context_length + 1`` long."""
    raw = _raw_text(source)
    text = "\n".join(raw["text"])
    if tokenizer == BYTES:
        stream = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    else:
        stream = np.asarray(load_tokenizer(tokenizer).encode(text), dtype=np.int64)
    width = context_length + 1
    count = len(stream) // width
    if count < 2:
        raise DataError(f"{source!r} has {len(stream)} tokens, too few for two examples of {width}")
    rows = stream[: count * width].reshape(count, width).astype(np.int64)
    num_val = max(1, int(round(count * val_fraction)))
    table = datasets.Dataset.from_dict({"tokens": rows})
    return table.select(range(count - num_val)), table.select(range(count - num_val, count))
