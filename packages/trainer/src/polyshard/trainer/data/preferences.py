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

A large set is prepared once (``polyshard prepare pairs.jsonl OUT --kind preferences``: the same rule per
line, streamed by workers) and ``data.source = OUT`` reads it: pair k is document k of the folder's
training split, its tokens taken apart by their mask bytes (:func:`polyshard.data.preference_rows.split_sides`),
cut and laid in rows by the same rule as a line's, read when a batch asks for it (:class:`PreparedPairs`).

Every example also carries ``pair``, its number within its set (training or validation): what a batch
holds, for a run whose reference log-probs were computed once (``dpo.reference = "precomputed"``).

Validation: ``data.val_source`` (another such file or folder), else a folder's held-out split (the one its
manifest records), else the last ``data.val_fraction`` of the pairs (at least one). An empty side, an
empty prompt, a line that is not such an object: one line naming the file, the line and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import numpy as np

from polyshard.data.chat import Chat
from polyshard.data.examples import IGNORE_INDEX, Arrays, Examples
from polyshard.data.preference_rows import pair_tokens, split_sides
from polyshard.data.prepared import Prepared, Split, open_prepared
from polyshard.data.tokenizer import Tokenizer, load_tokenizer
from polyshard.models import output_width, sequence_length
from polyshard.trainer.config import Config
from polyshard.trainer.data.language import RunData, is_prepared
from polyshard.trainer.errors import DataError

PREFERENCES = "preferences"  # the kind of a prepared folder of DPO pairs


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


def pair_rows(
    prompt: list[int], chosen: list[int], rejected: list[int], width: int, pad: int
) -> tuple[np.ndarray, ...]:
    """((2, width) tokens, (2, width) labels) of one pair, chosen first, cut by :func:`truncate`."""
    prompt, chosen, rejected = truncate(prompt, chosen, rejected, width)
    pair = [_row(prompt, side, width, pad) for side in (chosen, rejected)]
    return np.stack([t for t, _ in pair]), np.stack([label for _, label in pair])


def _numbered(tokens: np.ndarray, labels: np.ndarray) -> Arrays:
    return Arrays({"tokens": tokens, "labels": labels, "pair": np.arange(len(tokens), dtype=np.int64)})


class PreparedPairs:
    """Pairs ``[first, first + count)`` of a prepared split of kind ``preferences``, as (2, width) rows."""

    def __init__(self, split: Split, width: int, pad: int, first: int = 0, count: int | None = None):
        self.split, self.width, self.pad, self.first = split, width, pad, first
        self.count = split.documents - first if count is None else count

    def __len__(self) -> int:
        return self.count

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        tokens = np.empty((len(indices), 2, self.width), dtype=np.int64)
        labels = np.empty_like(tokens)
        for row, k in enumerate(indices):
            start, stop = self.split.document(self.first + int(k))
            sides = split_sides(self.split.read(start, stop), self.split.read_mask_bytes(start, stop))
            tokens[row], labels[row] = pair_rows(*sides, self.width, self.pad)
        return {"tokens": tokens, "labels": labels, "pair": np.asarray(indices, dtype=np.int64)}

    def largest_token(self) -> int:
        """The largest id of the split's shards, as the manifest records it (read where it does not)."""
        recorded = [s.max_token for s in self.split.shards]
        if all(top is not None for top in recorded):
            return max((top for top in recorded if top is not None), default=0)
        return max((int(self.split.read(a, min(a + (1 << 24), self.split.tokens)).max(initial=0))
                    for a in range(0, self.split.tokens, 1 << 24)), default=0)  # fmt: skip


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
            pair = pair_rows(*pair_tokens(row, tokenizer, chat, where), width, pad)
            tokens.append(pair[0])
            labels.append(pair[1])
    if not tokens:
        raise DataError(f"{field}={str(path)!r} holds no pairs; give one JSON object per line")
    return _numbered(np.stack(tokens), np.stack(labels))


def open_preferences(source: str, tokenizer: Tokenizer, field: str) -> Prepared:
    """The prepared folder ``source``, refused in one line unless its kind is ``preferences``."""
    prepared = open_prepared(source, tokenizer)
    kind = prepared.manifest.kind
    if kind != PREFERENCES:
        raise DataError(
            f"{field}={source!r} is a prepared folder of kind {kind!r}; a DPO run reads preference pairs: "
            f"prepare them with `polyshard prepare PAIRS.jsonl OUT --kind {PREFERENCES}`, or give the .jsonl"
        )
    return prepared


def _pairs_of(source: str, tokenizer: Tokenizer, width: int, field: str) -> tuple[Examples, Examples | None]:
    """(the pairs of ``source``, a prepared folder's held-out pairs or None)."""
    if not is_prepared(source):
        return read_pairs(Path(source).expanduser(), tokenizer, width, field), None
    prepared = open_preferences(source, tokenizer, field)
    eot = prepared.manifest.tokenizer.end_of_text
    pad = 0 if eot is None else eot
    held = None if prepared.val is None else PreparedPairs(prepared.val, width, pad)
    return PreparedPairs(prepared.train, width, pad), held


def preference_data(config: Config) -> RunData:
    """The run's training pairs and validation pairs (``data.val_source``, else a folder's held-out split,
    else the source's last ones)."""
    data, width = config.data, sequence_length(config.model) + 1
    tokenizer = load_tokenizer(data.tokenizer)
    pairs, val = _pairs_of(data.source, tokenizer, width, "data.source")
    if data.val_source is not None:
        val = _pairs_of(data.val_source, tokenizer, width, "data.val_source")[0]
    if val is not None:
        return RunData([pairs], [1.0], [data.source], val)
    count = len(pairs)
    held = max(1, int(round(count * data.val_fraction)))
    if held >= count:
        raise DataError(
            f"data.source={data.source!r} holds {count} pairs: too few for a training and a validation split; "
            "give more pairs or a data.val_source"
        )
    if isinstance(pairs, PreparedPairs):
        split, pad, first = pairs.split, pairs.pad, pairs.first
        train: Examples = PreparedPairs(split, width, pad, first, count - held)
        return RunData([train], [1.0], [data.source], PreparedPairs(split, width, pad, first + count - held, held))
    tokens, labels = cast(Arrays, pairs).columns["tokens"], cast(Arrays, pairs).columns["labels"]
    train = _numbered(tokens[: count - held], labels[: count - held])
    return RunData([train], [1.0], [data.source], _numbered(tokens[count - held :], labels[count - held :]))


def check_preference_data(config: Config) -> None:
    """Before any process starts: the file reads, each split holds what a step needs."""
    data = preference_data(config)
    batch = config.training.global_batch_size
    if len(data.train[0]) < batch:
        raise DataError(
            f"data.source={config.data.source!r} gives {len(data.train[0])} training pairs, fewer than one global "
            f"batch of training.global_batch_size={batch} pairs; use a smaller batch or more pairs"
        )
    largest = max(_largest_token(examples) for examples in (data.train[0], data.val))
    if largest >= output_width(config.model):
        raise DataError(
            f"data.source={config.data.source!r} holds token id {largest}, past model.vocab_size="
            f"{output_width(config.model)}; use the model's tokenizer or a larger vocabulary"
        )


def _largest_token(examples: Examples) -> int:
    if isinstance(examples, PreparedPairs):
        return examples.largest_token()
    return max(int(examples.rows(np.arange(len(examples)))["tokens"].max(initial=0)), 0)
