"""The workers' side of ``prepare``: a chunk of raw source parts in, its documents' tokens out.

A worker parses and checks its parts (every malformed line is a :class:`DataError` with the file, the
line and the fix), then tokenizes all the chunk's documents in one batch: ``encode_batch_fast`` of the
``tokenizers`` library for a ``tokenizer.json``, numpy over the UTF-8 bytes for the byte tokenizer. Each
document is tokenized alone and followed by its end: the end-of-text token, or when the tokenizer has
none the ``separator`` text tokenized alone. Fine-tuning pairs are ``tokens(prompt) + tokens(response)
+ [end of text]`` (nothing after the response when there is no end-of-text token), with a mask of 0 on
the prompt and 1 on the rest. DPO's preference pairs are ``prompt + chosen + rejected`` by the rule the
trainer's ``.jsonl`` reader applies (:func:`polyshard.data.preference_rows.pair_tokens`: text, token ids,
or messages through the tokenizer folder's chat template), each token's mask byte saying which part it
is; a line is tokenized on its own. Empty text documents are skipped.

The worker state (the tokenizer, the options) is built once per process by :func:`start`, so the
tasks themselves carry only the chunk; the same functions run in the main process when ``workers=1``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyshard.data.chat import Chat
from polyshard.data.errors import DataError
from polyshard.data.lifetime import end_with_parent
from polyshard.data.preference_rows import Sides, pair_tokens, side_mask
from polyshard.data.sources import Chunk, Fields, Part, too_long
from polyshard.data.tokenizer import ByteTokenizer, FileTokenizer, Tokenizer, load_tokenizer

# A document in "blank" mode: a run of lines holding something other than whitespace.
_BLOCK = re.compile(r"[^\n]*\S[^\n]*(?:\n[^\n]*\S[^\n]*)*")
_SURROGATE = re.compile("[\ud800-\udfff]")
PIECE = 1 << 16
_PIECES_AT_ONCE = 16  # pieces of one long document tokenized in one batch: about a million characters
"""Characters a tokenizer.json sees at once: a longer document is tokenized in pieces cut before a
space or a newline where there is one, so a tokenizer's memory stays bounded by the piece (BPE on one
50 MB line took 8.7 GB). Byte-level BPE starts a word at its space, so such a cut keeps the tokens."""


@dataclass(frozen=True)
class Encoded:
    """One chunk's documents end to end: ``tokens`` (dtype of the dataset), each document's length, and
    for pairs the loss mask (one byte per token)."""

    tokens: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray | None


@dataclass(frozen=True)
class PairRow:
    """A preference line as parsed (kind "preferences"): where it is, for messages, and the object."""

    where: str
    record: dict[str, Any]


Document = str | tuple[str, str] | PairRow


@dataclass(frozen=True)
class Settings:
    tokenizer: str
    """'bytes' or the path of a tokenizer.json: what each worker loads."""
    fields: Fields
    separator: str
    dtype: str


class Encoder:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.fields = settings.fields
        self.tokenizer: Tokenizer = load_tokenizer(settings.tokenizer)
        self.dtype = np.dtype(settings.dtype)
        self.chat = Chat(self.tokenizer) if self.fields.kind == "preferences" else None
        eot = self.tokenizer.end_of_text
        if eot is not None:
            self.end = [eot]
        elif self.fields.kind == "pairs":
            self.end = []  # the trainer's rule: with no end-of-text token the response is all there is
        else:
            self.end = self.tokenizer.encode(settings.separator)

    def __call__(self, chunk: Chunk) -> Encoded:
        documents = [d for part in chunk.parts for d in documents_of(part, self.fields)]
        if self.fields.kind == "text":
            return self._text([d for d in documents if isinstance(d, str)])
        if self.fields.kind == "preferences":
            return self._preferences([d for d in documents if isinstance(d, PairRow)])
        return self._pairs([d for d in documents if isinstance(d, tuple)])

    def _text(self, texts: list[str]) -> Encoded:
        if isinstance(self.tokenizer, ByteTokenizer):  # no Python work per token: one join, one copy
            end = bytes(self.end)
            raw = [t.encode("utf-8") + end for t in texts]
            lengths = np.fromiter(map(len, raw), np.int64, len(raw))
            return Encoded(np.frombuffer(b"".join(raw), np.uint8).astype(self.dtype), lengths, None)
        ids = self._encode(texts)
        lengths = np.fromiter((len(i) + len(self.end) for i in ids), np.int64, len(ids))
        return Encoded(self._array([x for i in ids for x in (i, self.end)], int(lengths.sum())), lengths, None)

    def _pairs(self, pairs: list[tuple[str, str]]) -> Encoded:
        prompts = self._encode([p for p, _ in pairs])
        responses = self._encode([r for _, r in pairs])
        sides = np.fromiter(
            (n for p, r in zip(prompts, responses) for n in (len(p), len(r) + len(self.end))), np.int64, 2 * len(pairs)
        )
        tokens = self._array([x for p, r in zip(prompts, responses) for x in (p, r, self.end)], int(sides.sum()))
        mask = np.repeat(np.tile(np.array([0, 1], np.uint8), len(pairs)), sides)
        return Encoded(tokens, sides.reshape(-1, 2).sum(axis=1), mask)

    def _preferences(self, rows: list[PairRow]) -> Encoded:
        assert self.chat is not None
        pairs = [self._pair(row) for row in rows]
        lengths = np.fromiter((sum(map(len, sides)) for sides in pairs), np.int64, len(pairs))
        tokens = self._array([side for sides in pairs for side in sides], int(lengths.sum()))
        mask = np.concatenate([side_mask(sides) for sides in pairs]) if pairs else np.empty(0, np.uint8)
        return Encoded(tokens, lengths, mask)

    def _pair(self, row: PairRow) -> Sides:
        assert self.chat is not None
        sides = pair_tokens(row.record, self.tokenizer, self.chat, row.where)
        top = max(max(side) for side in sides)
        if top >= self.tokenizer.vocab_size:  # ids given as such: the folder's dtype and manifest hold the vocabulary
            raise DataError(
                f"{row.where}: token id {top} is past the tokenizer's vocab_size={self.tokenizer.vocab_size}; "
                "prepare with the tokenizer the ids come from (--tokenizer)"
            )
        return sides

    def _encode(self, texts: list[str]) -> list[Any]:
        """Each text's ids (a list, or for bytes the UTF-8 bytes: iterating them gives the ids)."""
        if isinstance(self.tokenizer, FileTokenizer):
            inner = self.tokenizer.inner
            short = [t for t in texts if len(t) <= PIECE]
            ids = iter([e.ids for e in inner.encode_batch_fast(short)] if short else [])
            return [next(ids) if len(t) <= PIECE else self._long(t) for t in texts]
        if isinstance(self.tokenizer, ByteTokenizer):
            return [t.encode("utf-8") for t in texts]
        return [self.tokenizer.encode(t) for t in texts]

    def _long(self, text: str) -> np.ndarray:
        """A document past :data:`PIECE` characters: its pieces tokenized a few at a time, each piece's ids
        kept as 4 bytes apiece (a Python list of them costs ten times that)."""
        assert isinstance(self.tokenizer, FileTokenizer)
        cut, out = pieces(text), []
        for first in range(0, len(cut), _PIECES_AT_ONCE):
            batch = self.tokenizer.inner.encode_batch_fast(cut[first : first + _PIECES_AT_ONCE])
            out += [np.asarray(e.ids, np.uint32) for e in batch]
        return np.concatenate(out)

    def _array(self, parts: list[Any], count: int) -> np.ndarray:
        """The id sequences ``parts`` (lists, arrays, or bytes for the byte tokenizer) end to end."""
        tokens = np.empty(count, np.uint32)
        at = 0
        for part in parts:
            if isinstance(part, bytes):
                part = np.frombuffer(part, np.uint8)
            tokens[at : at + len(part)] = part
            at += len(part)
        top = int(tokens.max(initial=0))
        if top >= self.tokenizer.vocab_size:
            raise DataError(
                f"token id {top} is past the tokenizer's vocab_size={self.tokenizer.vocab_size}; "
                "the tokenizer file is inconsistent: train or download it again"
            )
        return tokens.astype(self.dtype)


def pieces(text: str) -> list[str]:
    """``text`` in pieces of at most :data:`PIECE` characters, each cut before a space or newline when the
    piece's second half has one."""
    out, start = [], 0
    while len(text) - start > PIECE:
        end = start + PIECE
        cut = max(text.rfind(" ", start + PIECE // 2, end), text.rfind("\n", start + PIECE // 2, end))
        cut = cut if cut > start else end
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def documents_of(part: Part, fields: Fields) -> list[Document]:
    """The documents of one part, in order, each checked."""
    if part.form == "arrow":
        assert isinstance(part.data, dict)
        return _rows(part, fields)
    assert isinstance(part.data, bytes)
    if part.form == "jsonl":
        return _json_lines(part.data, part.where, part.first, fields)
    text = _decode(part.data, part.where, part.first)
    if part.form == "file":
        return [text] if text else []
    blocks = [block.rstrip("\r") for block in _BLOCK.findall(text)]
    for block in blocks:
        if len(block) > fields.max_document_bytes:  # characters: at least as many bytes
            line = part.first + text.count("\n", 0, text.find(block))
            raise too_long(f"{part.where}, the document starting at line {line}", fields.max_document_bytes,
                           "put blank lines between its parts")  # fmt: skip
    return blocks


def _decode(data: bytes, where: str, first_line: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        raise DataError(
            f"{where}, line {line}: not UTF-8 text ({err.reason} at byte {err.start}); save the file as UTF-8"
        ) from err


def _json_lines(data: bytes, where: str, first_line: int, fields: Fields) -> list[Document]:
    documents: list[Document] = []
    for number, raw in enumerate(data.split(b"\n"), start=first_line):
        if not raw.strip():
            continue
        at = f"{where}, line {number}"
        if len(raw) > fields.max_document_bytes:  # the reader stops a longer one only when it spans reads
            raise too_long(at, fields.max_document_bytes, "split it into several lines")
        record = _record(raw, at, fields)
        if fields.kind == "preferences":  # checked and tokenized by preference_rows' rule
            documents.append(PairRow(at, record))
        elif fields.kind == "text":
            text = _field(record, fields.text_field, at, "--text-field", allow_empty=True)
            if text:
                documents.append(text)
        else:
            flag = "--prompt-field and --response-field"
            documents.append(
                (_field(record, fields.prompt_field, at, flag), _field(record, fields.response_field, at, flag))
            )
    return documents


def _record(raw: bytes, where: str, fields: Fields) -> dict[str, Any]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except RecursionError as err:
        raise DataError(f"{where}: JSON nested too deeply; each line must be one flat JSON object") from err
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start}); save the file as UTF-8") from err
    except json.JSONDecodeError as err:
        example = {c: "..." for c in fields.columns}
        raise DataError(
            f"{where}: not JSON ({err.msg} at column {err.colno}); each line must be one JSON object, "
            f"e.g. {json.dumps(example)}"
        ) from err
    if not isinstance(record, dict):
        kind = type(record).__name__
        raise DataError(f"{where}: a JSON {kind}, not an object with the fields {list(fields.columns)}")
    return record


def _field(record: dict[str, Any], name: str, where: str, flag: str, allow_empty: bool = False) -> str:
    if name not in record:
        raise DataError(
            f"{where}: no {name!r} field (it has {sorted(record)}); name the fields your file uses with {flag}"
        )
    value = record[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: {name!r} is a JSON {type(value).__name__}, not a string")
    surrogate = None if value.isascii() else _SURROGATE.search(value)  # isascii: O(1), no scan of plain text
    if surrogate:  # a "\ud800" escape: valid JSON, but not Unicode text (UTF-8 cannot encode it)
        raise DataError(
            f"{where}: {name!r} holds the lone surrogate \\u{ord(surrogate.group()):04x} at character "
            f"{surrogate.start()}, which is not Unicode text; fix or drop that escape"
        )
    if not value and not allow_empty:
        raise DataError(
            f"{where}: {name!r} is empty; every example needs a prompt and a response to learn from "
            "(for plain text without prompts use kind 'text')"
        )
    return value


def _rows(part: Part, fields: Fields) -> list[Document]:
    assert isinstance(part.data, dict)
    columns = [part.data[c].to_pylist() for c in fields.columns]
    for name, column in zip(fields.columns, columns):
        for row, value in enumerate(column, start=part.first):
            if value is not None and len(value) > fields.max_document_bytes:  # characters: at least as many bytes
                raise too_long(f"{part.where}, row {row}, {name!r}", fields.max_document_bytes, "split it into rows")
    if fields.kind == "text":
        return [t for t in columns[0] if t]  # a null or empty text is an empty document: skipped
    documents: list[Document] = []
    for row, (prompt, response) in enumerate(zip(*columns), start=part.first):
        for name, value in ((fields.prompt_field, prompt), (fields.response_field, response)):
            if not value:
                raise DataError(
                    f"{part.where}, row {row}: {name!r} is {'null' if value is None else 'empty'}; every example "
                    "needs a prompt and a response to learn from"
                )
        documents.append((prompt, response))
    return documents


# -- worker processes --------------------------------------------------------------------------------

_encoder: Encoder | None = None


def start(settings: Settings, parent: int) -> None:
    """A worker's initializer: end with the ``parent`` process, and load the tokenizer once. Each worker
    encodes on its own core, so the tokenizers library's own thread pool is turned off there."""
    global _encoder
    end_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _encoder = Encoder(settings)


def encode(chunk: Chunk) -> Encoded:
    """A worker's task."""
    assert _encoder is not None, "start() runs first in every worker"
    return _encoder(chunk)
