"""Preference pairs for ``training.task = "dpo"``: a ``.jsonl`` file, one pair per line, either as text

    {"prompt": "2+2=", "chosen": "4", "rejected": "5"}

tokenized with the run's tokenizer (``data.tokenizer``), its end-of-text token after each response as
the fine-tuning pairs get it, or already tokenized

    {"prompt_ids": [50, 43, 50, 61], "chosen_ids": [52], "rejected_ids": [53]}

used as given (no token added), or in TRL's conversational form

    {"prompt": [{"role": "user", "content": "2+2="}], "chosen": "4", "rejected": "5"}

when ``data.tokenizer`` is a tokenizer folder with a chat template (:mod:`polyshard.data.chat`: the prompt
rendered with the assistant turn's opening, each response as the assistant's turn, nothing appended: the
template ends the turn); ``chosen`` and ``rejected`` may also be lists of assistant messages.

Example k is pair k: ``tokens`` and ``labels`` of shape (2, width), chosen first, each row the prompt then
the response, padded (end-of-text, else 0); the labels are IGNORE_INDEX on the prompt and the padding. A
batch of b examples is 2b adjacent rows, so the two sides of a pair always share a microbatch on every layout.

Truncation, when a pair does not fit a row of ``width`` = context_length + 1 tokens: the prompt keeps its
*last* tokens, at most max(width // 2, width - the longer response) of them, then each response keeps
its *first* tokens up to the row's end (TRL's keep-end prompt, keep-start completion).

Validation: ``data.val_source`` (another such file), else the last ``data.val_fraction`` of the pairs
(at least one). An empty side, an empty prompt, a line that is not such an object: one line naming the
file, the line and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from polyshard.data.chat import Chat
from polyshard.data.examples import IGNORE_INDEX, Arrays
from polyshard.data.preference_rows import pair_tokens
from polyshard.data.tokenizer import Tokenizer, load_tokenizer
from polyshard.models import output_width, sequence_length
from polyshard.trainer.config import Config
from polyshard.trainer.data.language import RunData
from polyshard.trainer.errors import DataError


def truncate(prompt: list[int], chosen: list[int], rejected: list[int], width: int) -> tuple[list[int], ...]:
    """The module's rule: the prompt's end and each response's start that fit rows of ``width`` tokens."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= width:
        return prompt, chosen, rejected
    kept = min(len(prompt), max(width // 2, width - longest))
    prompt = prompt[len(prompt) - kept :]
    room = width - kept
    return prompt, chosen[:room], rejected[:room]


def _row(prompt: list[int], response: list[int], width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full(width, pad, dtype=np.int64)
    labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
    whole = prompt + response
    tokens[: len(whole)] = whole
    labels[len(prompt) : len(whole)] = response
    return tokens, labels


def read_pairs(path: Path, tokenizer: Tokenizer, width: int, field: str) -> Arrays:
    """Every pair of the file ``path`` as examples of (2, width) rows (see the module docstring)."""
    if not path.is_file():
        raise DataError(f'{field}={str(path)!r}: no such file; give a .jsonl of {{"prompt", "chosen", "rejected"}}')
    pad = 0 if tokenizer.end_of_text is None else tokenizer.end_of_text
    chat = Chat(tokenizer)
    tokens, labels = [], []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not a JSON object ({err.msg}); one pair per line") from err
            prompt, chosen, rejected = pair_tokens(row, tokenizer, chat, where)
            prompt, chosen, rejected = truncate(prompt, chosen, rejected, width)
            pair = [_row(prompt, side, width, pad) for side in (chosen, rejected)]
            tokens.append(np.stack([t for t, _ in pair]))
            labels.append(np.stack([label for _, label in pair]))
    if not tokens:
        raise DataError(f"{field}={str(path)!r} holds no pairs; give one JSON object per line")
    return Arrays({"tokens": np.stack(tokens), "labels": np.stack(labels)})


def preference_data(config: Config) -> RunData:
    """The run's training pairs and validation pairs (``data.val_source``, else the file's last ones)."""
    data, width = config.data, sequence_length(config.model) + 1
    tokenizer = load_tokenizer(data.tokenizer)
    pairs = read_pairs(Path(data.source).expanduser(), tokenizer, width, "data.source")
    if data.val_source is not None:
        val = read_pairs(Path(data.val_source).expanduser(), tokenizer, width, "data.val_source")
        return RunData([pairs], [1.0], [data.source], val)
    count = len(pairs)
    held = max(1, int(round(count * data.val_fraction)))
    if held >= count:
        raise DataError(
            f"data.source={data.source!r} holds {count} pairs: too few for a training and a validation split; "
            "give more pairs or a data.val_source"
        )
    columns = pairs.columns
    train = Arrays({k: v[: count - held] for k, v in columns.items()})
    return RunData([train], [1.0], [data.source], Arrays({k: v[count - held :] for k, v in columns.items()}))


def check_preference_data(config: Config) -> None:
    """Before any process starts: the file reads, each split holds what a step needs."""
    data = preference_data(config)
    batch = config.training.global_batch_size
    if len(data.train[0]) < batch:
        raise DataError(
            f"data.source={config.data.source!r} gives {len(data.train[0])} training pairs, fewer than one global "
            f"batch of training.global_batch_size={batch} pairs; use a smaller batch or more pairs"
        )
    largest = max(int(data.train[0].rows(np.arange(len(data.train[0])))["tokens"].max()), 0)
    if largest >= output_width(config.model):
        raise DataError(
            f"data.source={config.data.source!r} holds token id {largest}, past model.vocab_size="
            f"{output_width(config.model)}; use the model's tokenizer or a larger vocabulary"
        )
