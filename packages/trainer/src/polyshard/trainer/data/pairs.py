"""Fine-tuning data: JSON lines of prompt/response pairs, with a loss mask.

A ``data.source`` ending in ``.jsonl`` holds one JSON object per line with a
prompt and a response (the fields ``data.prompt_field`` and
``data.response_field``, e.g. "document" and "summary"); blank lines are
skipped. Each example is ``tokens(prompt) + tokens(response) + [end of text]``:
the tokenizer's end-of-text token when it has one (GPT-2's ``<|endoftext|>``),
so the model learns where a response stops. The byte tokenizer has none (all
256 ids are bytes): what the response holds is exactly what the model learns
to write, so end each response with your own marker (e.g. "\\n") if you want one.

Rows carry ``tokens`` and ``labels``, both ``context_length + 1`` long and
aligned as in Hugging Face's ``labels``: a response token's label is the token
itself, a prompt or padding position's is ``IGNORE_INDEX`` (-100). The trainer
shifts both by one, as for text: inputs ``tokens[:-1]``, targets ``labels[1:]``
(:func:`polyshard.trainer.loop.split_batch`). The loss then counts exactly the
predictions of response tokens.

- ``data.packing = false`` (the default): one example per row, padded with the
  end-of-text id (else 0; padding is never a target and, coming after the
  example, never attended to). A response longer than the room left after its
  prompt is cut at the row's end, as trl's ``max_length`` does; a prompt that
  leaves no room for one response token is an error.
- ``data.packing = true``: examples joined end to end and the stream cut into
  rows like text (the remainder dropped). No padding is wasted, but attention
  is the plain causal mask, so it crosses example boundaries: a token also
  sees the earlier examples of its row (the simple packing of Megatron-LM and
  torchtitan); long examples run on into the next row.

The last ``val_fraction`` of the examples (in file order) is the validation
split, padded or packed on its own. A mistake in the file is a
:class:`DataError` naming the file, the line and the fix;
:func:`check_pairs_source` reads the file the same way before any process starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from polyshard.data.tokenizer import Tokenizer, load_tokenizer
from polyshard.trainer.config import DataConfig
from polyshard.trainer.errors import DataError

IGNORE_INDEX = -100  # the label of a position the loss skips (a prompt or padding); PyTorch's default

Rows = dict[str, np.ndarray]  # "tokens" and "labels", each (rows, context_length + 1) int64


@dataclass(frozen=True)
class Example:
    line: int  # where it stands in the file, for error messages
    prompt: list[int]
    response: list[int]  # ends with the end-of-text token when the tokenizer has one


def read_pairs(path: Path, prompt_field: str, response_field: str) -> list[tuple[int, str, str]]:
    """(line number, prompt, response) of every non-blank line, each checked."""
    if not path.is_file():
        raise DataError(
            f"data.source={str(path)!r}: no such file; give a .jsonl file with one "
            f'{{"{prompt_field}": ..., "{response_field}": ...}} object per line'
        )
    pairs = []
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if raw.strip():
                where = f"{path}, line {number}"
                record = _record(raw, where)
                pairs.append((number, _text(record, prompt_field, where), _text(record, response_field, where)))
    if not pairs:
        raise DataError(f"{path} holds no examples; write one JSON object per line")
    return pairs


def _record(raw: bytes, where: str) -> dict[str, Any]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start}); save the file as UTF-8") from err
    except json.JSONDecodeError as err:
        raise DataError(
            f"{where}: not JSON ({err.msg} at column {err.colno}); each line must be one JSON object, "
            'e.g. {"prompt": "...", "response": "..."}'
        ) from err
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not an object with a prompt and a response")
    return record


def _text(record: dict[str, Any], field: str, where: str) -> str:
    if field not in record:
        raise DataError(
            f"{where}: no {field!r} field (it has {sorted(record)}); name the fields your file uses with "
            "data.prompt_field and data.response_field"
        )
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: {field!r} is a JSON {type(value).__name__}, not a string")
    if not value:
        raise DataError(
            f"{where}: {field!r} is empty; every example needs a prompt and a response to learn from "
            "(for plain text without prompts use a .txt source)"
        )
    return value


def tokenize(pairs: list[tuple[int, str, str]], tokenizer: Tokenizer) -> list[Example]:
    """Prompt and response tokenized apart, so the mask falls exactly between them."""
    end = [] if tokenizer.end_of_text is None else [tokenizer.end_of_text]
    return [
        Example(line, tokenizer.encode(prompt), tokenizer.encode(response) + end) for line, prompt, response in pairs
    ]


def padded_rows(examples: list[Example], width: int, pad_id: int, path: Path) -> Rows:
    """One example per row of ``width`` tokens, cut or padded; labels only on its response."""
    tokens = np.full((len(examples), width), pad_id, dtype=np.int64)
    labels = np.full((len(examples), width), IGNORE_INDEX, dtype=np.int64)
    for row, example in enumerate(examples):
        start = len(example.prompt)  # the first response token; predicted from position start - 1
        if start >= width:
            raise DataError(
                f"{path}, line {example.line}: the prompt is {start} tokens, leaving no room for a response in "
                f"rows of model.context_length+1={width} tokens (at most {width - 1} prompt tokens fit); shorten it, "
                "raise model.context_length, or set data.packing = true"
            )
        sequence = (example.prompt + example.response)[:width]
        tokens[row, : len(sequence)] = sequence
        labels[row, start : len(sequence)] = sequence[start:]
    return {"tokens": tokens, "labels": labels}


def packed_rows(examples: list[Example], width: int) -> Rows:
    """Every example end to end, cut into rows of ``width`` tokens; the remainder is dropped."""
    tokens = np.asarray([t for e in examples for t in e.prompt + e.response], dtype=np.int64)
    labels = np.asarray([t for e in examples for t in [IGNORE_INDEX] * len(e.prompt) + e.response], dtype=np.int64)
    used = len(tokens) // width * width
    return {"tokens": tokens[:used].reshape(-1, width), "labels": labels[:used].reshape(-1, width)}


def pair_rows(data: DataConfig, context_length: int) -> tuple[Rows, Rows]:
    """(train, validation) rows of ``data.source``: read, checked, tokenized, padded or packed."""
    path = Path(data.source).expanduser()
    tokenizer = load_tokenizer(data.tokenizer)
    examples = tokenize(read_pairs(path, data.prompt_field, data.response_field), tokenizer)
    num_val = max(1, int(round(len(examples) * data.val_fraction)))
    if num_val >= len(examples):
        raise DataError(f"{path} holds {len(examples)} example(s): too few for a training and a validation split")
    width = context_length + 1
    pad_id = 0 if tokenizer.end_of_text is None else tokenizer.end_of_text
    splits = examples[: len(examples) - num_val], examples[len(examples) - num_val :]
    if data.packing:
        return packed_rows(splits[0], width), packed_rows(splits[1], width)
    return padded_rows(splits[0], width, pad_id, path), padded_rows(splits[1], width, pad_id, path)


def pair_splits(data: DataConfig, context_length: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, validation) datasets of ``tokens`` and ``labels`` rows, ``context_length + 1`` long."""
    train, val = pair_rows(data, context_length)
    return datasets.Dataset.from_dict(train), datasets.Dataset.from_dict(val)


def check_pairs_source(data: DataConfig, context_length: int, global_batch: int, vocab_size: int) -> None:
    """Before any process starts: every line of the file is a valid pair, the tokens fit the model's
    vocabulary, and each split holds at least one global batch of rows."""
    path = Path(data.source).expanduser()
    for split, rows in zip(("training", "validation"), pair_rows(data, context_length)):
        count = len(rows["tokens"])
        if count < global_batch:
            what = "rows of packed examples" if data.packing else "examples"
            raise DataError(
                f"{path} gives {count} {split} {what}, fewer than one global batch of {global_batch}; "
                f"add examples, lower training.global_batch_size, or change data.val_fraction={data.val_fraction}"
            )
        top = int(rows["tokens"].max(initial=0))
        if top >= vocab_size:
            raise DataError(
                f"{path}: token id {top} (data.tokenizer={data.tokenizer!r}) is past model.vocab_size={vocab_size}; "
                f"use vocab_size >= {top + 1} or a tokenizer that fits the model"
            )
