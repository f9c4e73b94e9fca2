"""One preference pair's tokens: the rule DPO's ``.jsonl`` reader and ``prepare --kind preferences`` share.

A line is one of

    {"prompt": "2+2=", "chosen": "4", "rejected": "5"}                         text
    {"prompt": [{"role": "user", "content": "2+2="}], "chosen": "4", ...}     TRL's conversational form
    {"prompt_ids": [50, 43, 50, 61], "chosen_ids": [52], "rejected_ids": [53]}  token ids, used as given

Text is tokenized with the run's tokenizer, its end-of-text token after each response (as fine-tuning
pairs get it); conversational rows are rendered with the tokenizer folder's chat template
(:mod:`polyshard.data.chat`, nothing appended: the template ends the turn); ids get nothing added.
An empty prompt or response, a negative id, a line of another shape: one line naming the row and the fix.

In a prepared folder of kind ``preferences`` a pair is one document, ``prompt + chosen + rejected`` end to
end, and its mask byte says which part each token belongs to (:data:`PROMPT`, :data:`CHOSEN`,
:data:`REJECTED`), so a reader takes the three apart without another index.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyshard.data.chat import Chat, is_conversation
from polyshard.data.errors import DataError
from polyshard.data.tokenizer import Tokenizer

TEXT_FIELDS = ("prompt", "chosen", "rejected")
ID_FIELDS = ("prompt_ids", "chosen_ids", "rejected_ids")
PROMPT, CHOSEN, REJECTED = 0, 1, 2  # a prepared pair's mask byte per token

Sides = tuple[list[int], list[int], list[int]]


def pair_tokens(row: Any, tokenizer: Tokenizer, chat: Chat, where: str) -> Sides:
    """(prompt, chosen, rejected) token ids of one parsed line, checked (see the module docstring)."""
    sides = _sides(row, tokenizer, chat, where)
    if not sides[0]:
        raise DataError(f"{where}: the prompt is empty; a response's first token needs a token before it")
    if not sides[1] or not sides[2]:
        raise DataError(f"{where}: a response is empty; every pair needs two non-empty responses")
    return sides


def _sides(row: Any, tokenizer: Tokenizer, chat: Chat, where: str) -> Sides:
    if isinstance(row, dict) and is_conversation(row.get("prompt")) and "chosen" in row and "rejected" in row:
        prompt, (chosen, rejected) = chat.pair(row["prompt"], {k: row[k] for k in TEXT_FIELDS[1:]}, where)
        return prompt, chosen, rejected
    if isinstance(row, dict) and all(k in row for k in ID_FIELDS):
        sides = [row[k] for k in ID_FIELDS]
        for name, ids in zip(ID_FIELDS, sides):
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise DataError(f"{where}: {name} must be a list of token ids (integers), got {ids!r:.60}")
            if any(i < 0 for i in ids):
                raise DataError(f"{where}: {name} holds a negative token id; give ids in [0, the vocabulary)")
        return sides[0], sides[1], sides[2]
    if isinstance(row, dict) and all(isinstance(row.get(k), str) for k in TEXT_FIELDS):
        end = [] if tokenizer.end_of_text is None else [tokenizer.end_of_text]
        prompt, chosen, rejected = (row[k] for k in TEXT_FIELDS)
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            if not text:
                raise DataError(f"{where}: {name} is empty; every pair needs two non-empty responses")
        return tokenizer.encode(prompt), tokenizer.encode(chosen) + end, tokenizer.encode(rejected) + end
    raise DataError(
        f'{where}: expected {{"prompt", "chosen", "rejected"}} as text or {{"prompt_ids", "chosen_ids", '
        f'"rejected_ids"}} as lists of token ids, got {str(row)[:80]}'
    )


def side_mask(sides: Sides) -> np.ndarray:
    """The mask bytes of a pair stored as one document."""
    return np.repeat(np.array([PROMPT, CHOSEN, REJECTED], np.uint8), [len(s) for s in sides])


def split_sides(tokens: np.ndarray, mask: np.ndarray) -> Sides:
    """A stored pair's (prompt, chosen, rejected) ids from its tokens and mask bytes."""
    prompt, chosen, rejected = (tokens[mask == part].tolist() for part in (PROMPT, CHOSEN, REJECTED))
    return prompt, chosen, rejected
