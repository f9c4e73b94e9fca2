"""``prepare``: tokenize a corpus once into a prepared-dataset folder (:mod:`polyshard.data.format`).

The main process streams the source (:mod:`polyshard.data.sources`) in chunks of about ``chunk_bytes``
and hands them to ``workers`` processes (:mod:`polyshard.data.encode`); at most two chunks per worker
are in flight, and the results are written in source order as they complete
(:mod:`polyshard.data.shards`), so neither the corpus nor its tokens are ever held whole. The output
depends only on the documents, never on ``workers`` or ``chunk_bytes``.

Everything goes into a temporary folder beside ``out`` (``.<out>.prepare-tmp``), renamed into place
when complete (:mod:`polyshard.data.output`: the checks, the renames, and recovery from a kill).
After every chunk it records in ``progress.json`` how far it got: a run interrupted and started
again with the same source (paths, sizes, times), tokenizer and options reads the source again
(hashing it for the manifest) and tokenizes only what comes after; with anything changed it starts
over. An existing prepared dataset at ``out`` is replaced only with ``overwrite=True``; a folder
that is not one is never deleted.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from polyshard.data.chat import template_of
from polyshard.data.encode import Encoded, Encoder, Settings, encode, start
from polyshard.data.errors import DataError
from polyshard.data.format import (
    FORMAT,
    MASKED,
    VERSION,
    Manifest,
    dtype_name,
    token_dtype,
    tokenizer_info,
)
from polyshard.data.interrupted import Kept
from polyshard.data.locate import open_source
from polyshard.data.output import PROGRESS, check_out, ours, publish, temp_of, write_error
from polyshard.data.progress import Progress
from polyshard.data.shards import Resume, ShardWriter
from polyshard.data.sources import DOCUMENT_LIMIT, START, Chunk, Cursor, Fields
from polyshard.data.tokenizer import BYTES, ByteTokenizer, FileTokenizer, Tokenizer, load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MB of uint16 tokens per file: few files, each easy to copy
MAX_CHUNK_BYTES = 8 << 20  # source bytes per task: large batches, a few MB in flight per worker
MIN_CHUNK_BYTES = 1 << 20


def prepare(
    source: str | Path,
    out: str | Path,
    tokenizer: str | Path | Tokenizer = BYTES,
    *,
    kind: str = "text",
    split_on: str = "file",
    text_field: str = "text",
    prompt_field: str = "prompt",
    response_field: str = "response",
    separator: str = "\n",
    val_fraction: float = 0.01,
    seed: int = 0,
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    chunk_bytes: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    max_document_bytes: int = DOCUMENT_LIMIT,
    note: Callable[[str], None] | None = None,
) -> Manifest:
    """Tokenize ``source`` into the prepared dataset ``out`` and return its manifest.

    ``tokenizer``: 'bytes', a tokenizer.json (or a folder holding one). ``kind``: 'text' (documents),
    'pairs' (prompt/response objects, with a loss mask) or 'preferences' (DPO's prompt/chosen/rejected lines
    of .jsonl files as text, token ids or messages rendered with the tokenizer folder's chat template: one
    pair per document, each token's mask byte saying its part; :mod:`polyshard.data.preference_rows`).
    ``split_on``: a .txt file is one document ('file') or one per blank-line-separated block ('blank').
    ``separator`` ends each text document when the tokenizer has no end-of-text token. Document n is held
    out for ``val`` when ``held_out(seed, n, val_fraction)``. ``chunk_bytes`` (source bytes per task; by
    default 1-8 MB, so that every worker gets several tasks) changes the speed and the memory held, never
    the output.
    A document longer than ``max_document_bytes`` is refused, named, so memory stays bounded.
    ``note`` receives a line when the run resumes an interrupted one (what was already done).
    A :class:`DataError` names the file and the fix on bad input, a full disk or a folder that cannot be written.
    """
    fields = Fields(kind, split_on, text_field, prompt_field, response_field, max_document_bytes)
    workers = os.cpu_count() or 1 if workers is None else workers
    _check_numbers(val_fraction, workers, shard_tokens, 1 if chunk_bytes is None else chunk_bytes)
    spec, tok = _tokenizer(tokenizer)
    found = open_source(source, fields)
    if chunk_bytes is None:  # several tasks per worker, so none waits long for the last one
        chunk_bytes = min(max((found.total_bytes or 0) // (8 * workers), MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
    out = Path(out).expanduser()
    check_out(out, Path(source).expanduser() if found.files else None, overwrite)
    dtype = token_dtype(tok.vocab_size)
    info = tokenizer_info(tok)
    ends_with = separator if tok.end_of_text is None and kind == "text" else None
    settings = Settings(spec, fields, separator, dtype.str)
    fingerprint = json.loads(json.dumps({
        "format": [FORMAT, VERSION], "source": found.fingerprint(), "tokenizer": info.sha256, "fields": vars(fields),
        "separator": ends_with, "val_fraction": val_fraction, "seed": seed, "shard_tokens": shard_tokens,
        "template": _template_hash(spec) if kind == "preferences" else None,  # conversational rows render with it
    }))  # fmt: skip
    temp = temp_of(out)
    try:
        resumed = _resume(temp, fingerprint)
        masked = kind in MASKED
        writer = _writer(temp, dtype, masked, shard_tokens, seed, val_fraction, resumed)
        cursor: Cursor = START if writer.documents == 0 or resumed is None else tuple(resumed["cursor"])
        if cursor != START and note is not None:
            done = Kept(temp, writer.documents, writer.tokens)
            note(
                f"resuming an interrupted prepare of {out}: {done} were done and are kept; the source is read "
                "again from the start (to hash it) and tokenized from where it stopped"
            )
        bar = Progress(found.total_bytes, progress)
        try:
            for encoded, end in _encoded(found.chunks(cursor, chunk_bytes, bar.read), settings, workers):
                writer.add(encoded)
                writer.flush()
                _save_progress(temp, {"fingerprint": fingerprint, "cursor": list(end), **writer.state()})
                bar.update(writer.documents, writer.tokens)
        except DataError:
            shutil.rmtree(temp, ignore_errors=True)  # the source must change before a run can succeed
            raise
        splits = writer.finish()
        if "train" not in splits:
            shutil.rmtree(temp, ignore_errors=True)
            held = f"all {splits['val'].documents} documents were held out" if splits else "it holds no documents"
            raise DataError(f"{source}: nothing to train on: {held}; give a non-empty source or a lower val_fraction")
        manifest = Manifest(kind, dtype_name(dtype), info, ends_with, found.infos(), val_fraction, seed, splits)
        manifest.write(temp)
        (temp / PROGRESS).unlink()
        publish(temp, out)
    except OSError as err:  # a full disk, a folder made read-only: the line says which and what to do
        raise write_error(err, out) from err
    bar.done()
    return manifest


def _check_numbers(val_fraction: float, workers: int, shard_tokens: int, chunk_bytes: int) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} is not in [0, 1); e.g. 0.01 holds out 1% of the documents")
    for name, value in (("workers", workers), ("shard_tokens", shard_tokens), ("chunk_bytes", chunk_bytes)):
        if value < 1:
            raise DataError(f"{name}={value}; give at least 1")


def _tokenizer(tokenizer: str | Path | Tokenizer) -> tuple[str, Tokenizer]:
    """What workers load (a spec) and the tokenizer itself."""
    if isinstance(tokenizer, ByteTokenizer):
        return BYTES, tokenizer
    if isinstance(tokenizer, FileTokenizer):
        return str(tokenizer.path), tokenizer
    if isinstance(tokenizer, str | Path):
        loaded = load_tokenizer(str(tokenizer))
        return (str(loaded.path) if isinstance(loaded, FileTokenizer) else BYTES), loaded
    raise DataError(f"tokenizer={tokenizer!r}: give 'bytes' or a tokenizer.json (workers load it by its path)")


def _template_hash(spec: str) -> str | None:
    """The sha256 of the chat template the tokenizer's folder holds (None: none), so a resumed prepare of
    conversational rows never mixes two renderings."""
    template = template_of(spec)
    return None if template is None else hashlib.sha256(template.text.encode()).hexdigest()


def _resume(temp: Path, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    """The progress of an interrupted run with the same fingerprint, or None (the folder then empty)."""
    if not temp.exists():
        temp.mkdir()
        return None
    strays = [p for p in temp.iterdir() if not ours(p)] if temp.is_dir() else [temp]
    if strays:
        what = ("the link " if strays[0].is_symlink() else "") + strays[0].name  # a prepare never makes links
        raise DataError(f"{temp} is not a prepare's temporary folder (it holds {what}); move it away")
    try:
        state: dict[str, Any] = json.loads((temp / PROGRESS).read_text())
        if state.get("fingerprint") == fingerprint:
            keep = {n for split in ("train", "val") for n in _shard_names(state[split])}
            for path in temp.iterdir():
                if path.name != PROGRESS and path.name.rsplit(".", 1)[0] not in keep:
                    path.unlink()  # a shard begun after the last progress record
            return state
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass  # no usable progress record: start over
    for path in temp.iterdir():
        path.unlink()
    return None


def _shard_names(split: dict[str, Any]) -> list[str]:
    return [s[0] for s in split["closed"]] + ([split["open"][0]] if split["open"] else [])


def _writer(temp: Path, dtype: Any, masked: bool, shard_tokens: int, seed: int, val_fraction: float,
            resumed: dict[str, Any] | None) -> ShardWriter:  # fmt: skip
    try:
        return ShardWriter(temp, dtype, masked, shard_tokens, seed, val_fraction, resumed)
    except (Resume, KeyError, TypeError, ValueError):
        for path in temp.iterdir():  # the files do not match the record: start over
            path.unlink()
        return ShardWriter(temp, dtype, masked, shard_tokens, seed, val_fraction, None)


def _save_progress(temp: Path, state: dict[str, Any]) -> None:
    tmp = temp / (PROGRESS + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(temp / PROGRESS)


# -- the workers ---------------------------------------------------------------------------------


def _encoded(chunks: Iterator[Chunk], settings: Settings, workers: int) -> Iterator[tuple[Encoded, Cursor]]:
    """Each chunk's tokens, in order, with the cursor past it; ``workers`` processes, two chunks each in flight."""
    if workers == 1:
        encoder = Encoder(settings)
        for chunk in chunks:
            yield encoder(chunk), chunk.end
        return
    # spawn: the workers start clean whatever the parent holds (threads, a used tokenizers pool).
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=start, initargs=(settings, os.getpid()))
    pending: deque[tuple[Future[Encoded], Cursor]] = deque()
    try:
        for chunk in chunks:
            pending.append((pool.submit(encode, chunk), chunk.end))
            if len(pending) >= 2 * workers:
                future, end = pending.popleft()
                yield future.result(), end
        while pending:
            future, end = pending.popleft()
            yield future.result(), end
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
