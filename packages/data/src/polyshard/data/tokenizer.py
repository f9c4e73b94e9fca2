"""Tokenizers: UTF-8 bytes (the default, no vocabulary file) or a Hugging Face ``tokenizer.json``.

``data.tokenizer = "bytes"`` maps each byte to a token in [0, 256). Any other value names a
``tokenizer.json`` (or a folder holding one, such as a ``transformers`` model folder), loaded with
the ``tokenizers`` library (``pip install tokenizers``; it comes with ``transformers``).
:func:`train_bpe` trains a byte-level BPE on local text, the kind GPT-2 uses, so every string
round-trips exactly.

``end_of_text`` is the id of the token that ends a document (GPT-2's ``<|endoftext|>``, Llama's
``</s>`` or ``<|end_of_text|>``), or None: the byte tokenizer has none. A BPE from :func:`train_bpe`
has GPT-2's, as its last id. Prepared text ends each document with it, and fine-tuning data each
response (:mod:`polyshard.data.encode`): without one a response has no end to learn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Protocol

from polyshard.data.errors import DataError

BYTES = "bytes"
FILE = "tokenizer.json"
# Special tokens that end a document, by the names common tokenizers give them (first match wins).
END_OF_TEXT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
END_OF_TEXT = END_OF_TEXT_NAMES[0]  # the one train_bpe adds, GPT-2's


class Tokenizer(Protocol):
    vocab_size: int
    end_of_text: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Each UTF-8 byte is a token; a token past the byte range (a larger model vocabulary) decodes as U+FFFD."""

    vocab_size = 256
    end_of_text: int | None = None  # every id is a byte of text; no id is left for a special token

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        text, run = [], bytearray()
        for t in (int(t) for t in ids):
            if t < self.vocab_size:
                run.append(t)
                continue
            text.append(run.decode("utf-8", errors="replace") + "\ufffd")
            run = bytearray()
        return "".join(text) + run.decode("utf-8", errors="replace")


class FileTokenizer:
    """A ``tokenizer.json`` read by the ``tokenizers`` library."""

    def __init__(self, path: Path):
        tokenizers = _tokenizers()
        try:
            self.inner = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # the library raises its own exception type for a malformed file
            raise DataError(f"data.tokenizer: {path} is not a tokenizer file tokenizers can read ({err})") from err
        self.path = path
        self.vocab_size: int = self.inner.get_vocab_size()
        special = {t.content: i for i, t in self.inner.get_added_tokens_decoder().items() if t.special}
        self.end_of_text: int | None = next((special[n] for n in END_OF_TEXT_NAMES if n in special), None)

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.inner.decode([int(i) for i in ids], skip_special_tokens=False))


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"``, or the ``tokenizer.json`` that ``spec`` names (directly or inside a folder)."""
    if spec == BYTES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / FILE
    if not path.is_file():
        raise DataError(f"data.tokenizer={spec!r}: no {FILE} there; give 'bytes', a {FILE} or a folder holding one")
    return FileTokenizer(path)


def train_bpe(
    texts: Iterable[str], vocab_size: int, destination: str | Path, *, end_of_text: str | None = END_OF_TEXT
) -> Path:
    """Train a byte-level BPE of ``vocab_size`` tokens (256 bytes + merges + ``end_of_text``, a special
    token with the last id, as GPT-2's; None: no such token) on ``texts``; save it as
    ``destination`` (a ``tokenizer.json``), written whole or not at all. A small corpus may give fewer
    merges, so fewer tokens: ``vocab_size`` is the most."""
    if vocab_size <= 256:
        raise DataError(f"a BPE vocabulary needs more than the 256 byte tokens; got vocab_size={vocab_size}")
    if end_of_text is not None and end_of_text not in END_OF_TEXT_NAMES:
        raise DataError(f"end_of_text={end_of_text!r}; choose one of {list(END_OF_TEXT_NAMES)}, the names read back")
    tokenizers = _tokenizers()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    merged = vocab_size - (end_of_text is not None)  # the bytes and merges; the special token comes last
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=merged, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if end_of_text is not None:  # added after training, so it takes the last id (GPT-2's 50256 is its last)
        tokenizer.add_special_tokens([tokenizers.AddedToken(end_of_text, special=True)])
    destination = Path(destination)
    tmp = destination.with_name(destination.name + ".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(destination)
    return destination


def _tokenizers() -> ModuleType:
    try:
        import tokenizers
    except ImportError as err:
        raise DataError("data.tokenizer needs the tokenizers library: pip install tokenizers") from err
    return tokenizers
