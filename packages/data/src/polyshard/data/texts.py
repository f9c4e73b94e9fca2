"""A source's documents as text, read by ``prepare``'s own reader: what ``polyshard tokenizer`` trains on.

Any source ``prepare`` reads works here and is checked the same way (``.txt``, ``.jsonl[.gz|.zst]``,
``.parquet``, folders of them, ``save_to_disk`` folders, dataset names): :func:`open_source` finds and
checks it, :meth:`Source.chunks` streams it, and :func:`documents_of` parses each part (a malformed JSON
line is named with its file and line). Fine-tuning pairs give their prompt and their response, each a text.
Nothing is tokenized, and one chunk of the source is in memory at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from polyshard.data.encode import documents_of
from polyshard.data.locate import open_source
from polyshard.data.sources import START, Chunk, Fields

CHUNK_BYTES = 1 << 20  # source bytes parsed at a time


def source_texts(spec: str | Path, fields: Fields | None = None) -> Iterator[str]:
    """Every document of the source ``spec`` names, in the order ``prepare`` reads them; empty ones skipped."""
    fields = fields or Fields()
    source = open_source(spec, fields)  # checked before the first text is asked for
    return _texts(source.chunks(START, CHUNK_BYTES, lambda count: None), fields)


def _texts(chunks: Iterator[Chunk], fields: Fields) -> Iterator[str]:
    for chunk in chunks:
        for part in chunk.parts:
            for document in documents_of(part, fields):
                if isinstance(document, str):
                    yield document
                elif isinstance(document, tuple):  # a prompt and its response (a preference row: no text here)
                    yield from document
