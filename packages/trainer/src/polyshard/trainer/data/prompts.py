"""Prompts for ``training.task = "grpo"``: a ``.jsonl`` file, one prompt per line, as text

    {"prompt": "3+4=", "answer": "7"}

tokenized with the run's tokenizer (``data.tokenizer``; no token added), or already tokenized

    {"prompt_ids": [51, 43, 52, 61], "answer": "7"}

used as given (its text, for the rewards, is the tokenizer's decoding), or in TRL's conversational form

    {"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"}

rendered with the chat template of the ``data.tokenizer`` folder and the assistant turn's opening
(:mod:`polyshard.data.chat`; its text, for the rewards, is the rendering). Every other field of a line is a
*column*: the reward functions get it, aligned with the completions (TRL's convention), e.g. the
``answer`` that :func:`polyshard.trainer.tasks.rewards.exact_answer` compares with.

A prompt and its longest completion must fit one row: prompt tokens + ``grpo.max_completion_length`` <=
``model.context_length`` + 1 (the row's last token is a target, never an input). A prompt that does not is
an error naming its line, not cut: a cut prompt asks another question, so its reward would mislead.

The loader serves prompt *numbers* (column ``row``): example k is prompt k, so the sharded loader's
order, resume and dp split apply unchanged, and a step's prompts are known on every layout by their
place in the global batch. Validation: ``data.val_source`` (another such file), else the file's last
``data.val_fraction`` prompts (at least one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polyshard.data.chat import Chat, is_conversation
from polyshard.data.examples import Arrays
from polyshard.data.tokenizer import Tokenizer, load_tokenizer
from polyshard.models import output_width, sequence_length
from polyshard.trainer.config import Config
from polyshard.trainer.data.language import RunData
from polyshard.trainer.errors import DataError

MAX_LINE_BYTES = 1 << 20  # a prompt line larger than 1 MiB is not a prompt a small context holds


@dataclass(frozen=True)
class Prompt:
    """One line: its token ids, its text (what the rewards see) and its other fields."""

    ids: list[int]
    text: str
    columns: dict[str, Any] = field(default_factory=dict)


def _prompt(row: Any, tokenizer: Tokenizer, chat: Chat, where: str) -> Prompt:
    if not isinstance(row, dict):
        raise DataError(
            f'{where}: expected a JSON object {{"prompt": "..."}} or {{"prompt_ids": [...]}}, got {str(row)[:80]}'
        )
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise DataError(f"{where}: prompt_ids must be a list of token ids (integers >= 0), got {ids!r:.60}")
        columns = {k: v for k, v in row.items() if k != "prompt_ids"}
        return Prompt(ids, tokenizer.decode(ids), columns)
    text = row.get("prompt")
    columns = {k: v for k, v in row.items() if k != "prompt"}
    if is_conversation(text):
        ids, rendered = chat.prompt(text, where)
        return Prompt(ids, rendered, columns)
    if not isinstance(text, str):
        raise DataError(f'{where}: no "prompt" text (or "prompt_ids"); got the fields {sorted(row)[:8]}')
    return Prompt(tokenizer.encode(text), text, columns)


def read_prompts(path: Path, tokenizer: Tokenizer, room: int, vocab: int, field_name: str) -> list[Prompt]:
    """Every prompt of ``path``; ``room``: the most prompt tokens a row leaves beside the longest completion."""
    if not path.is_file():
        raise DataError(f'{field_name}={str(path)!r}: no such file; give a .jsonl of {{"prompt": "..."}} lines')
    prompts, chat = [], Chat(tokenizer)
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            if len(line) > MAX_LINE_BYTES:
                raise DataError(f"{where}: longer than {MAX_LINE_BYTES} characters; one short prompt per line")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not a JSON object ({err.msg}); one prompt per line") from err
            prompt = _prompt(row, tokenizer, chat, where)
            if not prompt.ids:
                raise DataError(f"{where}: the prompt is empty; a completion's first token needs a token before it")
            if len(prompt.ids) > room:
                raise DataError(
                    f"{where}: the prompt is {len(prompt.ids)} tokens, but a row leaves {room} beside "
                    "grpo.max_completion_length; shorten it, lower grpo.max_completion_length or raise "
                    "model.context_length"
                )
            if max(prompt.ids) >= vocab:
                raise DataError(
                    f"{where}: token id {max(prompt.ids)} is past model.vocab_size={vocab}; use the model's tokenizer"
                )
            prompts.append(prompt)
    if not prompts:
        raise DataError(f"{field_name}={str(path)!r} holds no prompts; give one JSON object per line")
    return prompts


def prompt_room(config: Config) -> int:
    """The most prompt tokens a row holds beside a completion of ``grpo.max_completion_length`` tokens."""
    completion = config.grpo.max_completion_length if config.grpo is not None else 0
    return sequence_length(config.model) + 1 - completion


@dataclass(frozen=True)
class PromptSets:
    """A GRPO run's prompts: the training ones and the validation ones."""

    train: list[Prompt]
    val: list[Prompt]


def prompt_sets(config: Config) -> PromptSets:
    """The run's training prompts and validation prompts (``data.val_source``, else the file's last ones)."""
    data = config.data
    tokenizer = load_tokenizer(data.tokenizer)
    room, vocab = prompt_room(config), output_width(config.model)
    prompts = read_prompts(Path(data.source).expanduser(), tokenizer, room, vocab, "data.source")
    if data.val_source is not None:
        val = read_prompts(Path(data.val_source).expanduser(), tokenizer, room, vocab, "data.val_source")
        return PromptSets(prompts, val)
    held = max(1, int(round(len(prompts) * data.val_fraction)))
    if held >= len(prompts):
        raise DataError(
            f"data.source={data.source!r} holds {len(prompts)} prompts: too few for a training and a validation "
            "split; give more prompts or a data.val_source"
        )
    return PromptSets(prompts[: len(prompts) - held], prompts[len(prompts) - held :])


def _numbers(count: int) -> Arrays:
    return Arrays({"row": np.arange(count, dtype=np.int64)})


def prompt_data(config: Config) -> RunData:
    """The loader's view: each split as prompt numbers (column ``row``) into :func:`prompt_sets`' lists."""
    sets = prompt_sets(config)
    return RunData([_numbers(len(sets.train))], [1.0], [config.data.source], _numbers(len(sets.val)))


def check_prompt_data(config: Config) -> None:
    """Before any process starts: the file reads, every prompt fits, a step's prompts exist."""
    sets = prompt_sets(config)
    batch = config.training.global_batch_size
    if len(sets.train) < batch:
        raise DataError(
            f"data.source={config.data.source!r} gives {len(sets.train)} training prompts, fewer than one global "
            f"batch of training.global_batch_size={batch} prompts; use a smaller batch or more prompts"
        )
