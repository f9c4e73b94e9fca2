"""Language data for a run: every source becomes a prepared dataset, read through memory maps.

``data.source`` (or each of ``data.sources``) is either a prepared folder (``polyshard prepare``) or
anything ``prepare`` reads: ``"shakespeare"``, a ``.txt`` file or folder (one document per file), a
``.jsonl`` of prompt/response pairs, a dataset name; or ``"synthetic"``, seeded rows of the model's
vocabulary that read no file at all (:mod:`polyshard.data.synthetic`). Such a source is prepared on first use into the
cache, ``<cache>/prepared/<key>``, where the key hashes the source's bytes, the tokenizer and the
options, so a changed file or tokenizer is prepared afresh and an unchanged one never again. The
launcher prepares before any worker starts (with a progress bar); a worker started another way
prepares on rank 0 while the others wait (:func:`~polyshard.trainer.loop.trainer.make_loaders`).

Examples (:mod:`polyshard.data.examples`): text and packed pairs are windows of
``context_length + 1`` tokens of the training split's stream; padded pairs one document per row.
Validation is the held-out documents (the folder's ``val`` split, ``data.val_fraction`` of them
chosen by a seeded hash when prepared) or ``data.val_source``; a corpus too small to hold out a whole
document (one document, or none drawn) holds out the last ``val_fraction`` of its windows instead.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyshard.data.examples import Concat, Documents, Examples, Windows
from polyshard.data.format import MANIFEST, TOKENS, held_out, tokenizer_info
from polyshard.data.output import WriteError
from polyshard.data.prepared import Prepared, Split, open_prepared
from polyshard.data.sources import check_within
from polyshard.data.synthetic import TRAIN_STREAM, VAL_STREAM, SyntheticTokens
from polyshard.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from polyshard.models import output_width, sequence_length
from polyshard.trainer.config import Config, DataConfig
from polyshard.trainer.data.corpus import cache_root, shakespeare_files
from polyshard.trainer.errors import DataError

SYNTHETIC = "synthetic"  # data.source: Megatron's mock data, seeded rows and no file (polyshard.data.synthetic)
SPLIT_SEED = 0  # which documents a source prepared on the fly holds out; a prepared folder records its own
PAIRS_SUFFIX = ".jsonl"


def is_prepared(source: str) -> bool:
    return (Path(source).expanduser() / MANIFEST).is_file()


def local_files(source: str, field: str = "data.source") -> list[Path] | None:
    """The files a built-in or local source reads; None for a dataset name (read by ``datasets``)."""
    if source == "shakespeare":
        return shakespeare_files()
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        for file in files:  # hashed for the cache key before prepare reads them: nothing outside the folder
            check_within(path, file, f"{field} folder")
        if not files:
            raise DataError(
                f"{field}={source!r} is a folder with neither a {MANIFEST} (a prepared dataset) nor .txt files"
            )
        return files
    if path.exists():
        return [path]
    if "/" in source or path.suffix in (".txt", PAIRS_SUFFIX):
        raise DataError(
            f"{field}={source!r}: no such file or folder; give 'shakespeare', a prepared folder, "
            "a .txt file or folder, or a .jsonl of prompt/response pairs"
        )
    return None


def _cache_key(source: str, files: list[Path] | None, data: DataConfig, tokenizer: Tokenizer, kind: str) -> str:
    digest = hashlib.sha256()
    options = (kind, tokenizer_info(tokenizer).sha256, data.separator, data.val_fraction, SPLIT_SEED)
    digest.update(repr((options, data.prompt_field, data.response_field) if kind == "pairs" else options).encode())
    for path in files or []:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    if files is None:
        digest.update(source.encode())
    return digest.hexdigest()[:24]


def prepared_folder(source: str, data: DataConfig, *, progress: bool = False, field: str = "data.source") -> Path:
    """``source`` as a prepared folder: itself, or its copy in the cache, prepared now if missing."""
    if is_prepared(source):
        return Path(source).expanduser()

    kind = "pairs" if Path(source).suffix == PAIRS_SUFFIX else "text"
    if kind == "pairs" and not Path(source).expanduser().is_file():
        raise DataError(
            f"{field}={source!r}: no such file; give a .jsonl file with one "
            f'{{"{data.prompt_field}": ..., "{data.response_field}": ...}} object per line'
        )
    files = local_files(source, field)
    tokenizer = load_tokenizer(data.tokenizer)
    target = cache_root() / "prepared" / _cache_key(source, files, data, tokenizer, kind)
    if (target / MANIFEST).is_file():
        return target
    try:
        return _prepare_into(target, source, files, data, kind, progress)
    except (OSError, WriteError) as err:  # the cache's disk is full or read-only
        where, reason = (err.where, err.reason) if isinstance(err, WriteError) else (err.filename, err.strerror)
        raise DataError(
            f"preparing {field}={source!r} into the cache {target.parent}: cannot write {where or target} "
            f"({reason or err}); free space there, or set POLYSHARD_CACHE to a writable folder with room"
        ) from err


def _prepare_into(
    target: Path, source: str, files: list[Path] | None, data: DataConfig, kind: str, progress: bool
) -> Path:
    from polyshard.data.prepare import prepare

    target.parent.mkdir(parents=True, exist_ok=True)
    origin = str(files[0].parent) if source == "shakespeare" and files else source
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".preparing-") as tmp:
        staged = Path(tmp) / "dataset"
        prepare(
            origin,
            staged,
            data.tokenizer,
            kind=kind,
            prompt_field=data.prompt_field,
            response_field=data.response_field,
            separator=data.separator,
            val_fraction=data.val_fraction,
            seed=SPLIT_SEED,
            # a daemonic process (a test's worker pool) may not start the tokenizing workers: it tokenizes itself
            workers=1 if multiprocessing.current_process().daemon else min(4, os.cpu_count() or 1),
            progress=progress,
        )
        try:
            staged.rename(target)
        except OSError:
            if not (target / MANIFEST).is_file():  # another process may have won the race; that is fine
                raise
    return target


@dataclass(frozen=True)
class RunData:
    """What a run reads: its training sources with their weights and names, and its validation examples."""

    train: list[Examples]
    weights: list[float]
    names: list[str]
    val: Examples


def _examples(
    prepared: Prepared, data: DataConfig, width: int, where: str, check: bool
) -> tuple[Examples, Examples | None]:
    """(training examples, the held-out ones or None) of one prepared source; with ``check``, every padded
    example is read once to find a prompt that leaves its row no room (the launcher's check, not a rank's)."""
    if prepared.manifest.kind == "preferences":  # one DPO pair per document: no next-token rows to cut
        raise DataError(
            f"{where} is a prepared folder of kind 'preferences' (DPO pairs); a language run reads kind 'text' "
            "or 'pairs': set training.task = 'dpo' to train on it, or prepare the data with --kind text or pairs"
        )
    pairs = prepared.manifest.kind == "pairs"
    segments = data.document_mask
    if pairs and not data.packing:
        eot = prepared.manifest.tokenizer.end_of_text
        pad = 0 if eot is None else eot

        def documents(split: Split, first: int = 0, count: int | None = None) -> Documents:
            made = Documents(split, width, pad, first=first, count=count, segments=segments)
            prompt, which = made.longest_prompt() if check else (0, 0)
            if prompt >= width:
                held = split is prepared.val
                line = _source_line(prepared, held, first + which, _named(data))
                at = f"{line[0]}, line {line[1]}" if line else f"{where}: example {first + which}"
                raise DataError(
                    f"{at}: the prompt is {prompt} tokens, leaving no room for a response in rows of "
                    f"model.context_length+1={width} tokens (at most {width - 1} prompt tokens fit); shorten it, "
                    "raise model.context_length, or set data.packing = true"
                )
            return made

        if prepared.val is not None:
            return documents(prepared.train), documents(prepared.val)
        held = _tail(prepared.train.documents, data.val_fraction, where, "examples")
        return documents(prepared.train, 0, prepared.train.documents - held), documents(
            prepared.train, prepared.train.documents - held, held
        )
    if prepared.val is not None:
        return Windows(prepared.train, width, segments=segments), Windows(prepared.val, width, segments=segments)
    total = prepared.train.tokens // width
    held = _tail(total, data.val_fraction, where, f"windows of {width} tokens")
    train = Windows(prepared.train, width, count=total - held, segments=segments)
    return train, Windows(prepared.train, width, first=total - held, count=held, segments=segments)


def _named(data: DataConfig) -> set[Path]:
    """The sources the config names, resolved: the only files outside a prepared folder a run reads."""
    paths = [e.path for e in data.mixture] + ([data.val_source] if data.val_source is not None else [])
    return {Path(p).expanduser().resolve() for p in paths}


def _source_line(prepared: Prepared, val: bool, index: int, named: set[Path]) -> tuple[str, int] | None:
    """(file, line) of document ``index`` of a split prepared from one JSON-lines file, else None: the
    document's number in the file is the ``index``-th one that :func:`held_out` sent to the split. The
    file a manifest names is opened only when the config names it too (a manifest may name any path)."""
    sources = prepared.manifest.sources
    path = Path(sources[0].name) if len(sources) == 1 else None
    if path is None or path.resolve() not in named or not path.is_file():
        return None
    seen, number = -1, -1
    for start in range(0, 1 << 62, 1 << 16):
        chosen = held_out(prepared.manifest.seed, np.arange(start, start + (1 << 16)), prepared.manifest.val_fraction)
        mine = np.flatnonzero(chosen if val else ~chosen)
        if seen + len(mine) >= index:
            number = start + int(mine[index - seen - 1])
            break
        seen += len(mine)
    with open(path, "rb") as lines:
        documents = (n for n, raw in enumerate(lines, start=1) if raw.strip())
        return str(path), next(itertools.islice(documents, number, None), 0)


def _tail(count: int, fraction: float, where: str, what: str) -> int:
    held = max(1, int(round(count * fraction)))
    if held >= count:
        raise DataError(f"{where} holds {count} {what}: too few for a training and a validation split")
    return held


def language_data(config: Config, *, progress: bool = False, check: bool = False) -> RunData:
    """The run's training sources (with weights) and validation examples; ``check`` also reads every
    padded example once (before launch: :func:`check_language_data`)."""
    data, width = config.data, sequence_length(config.model) + 1
    tokenizer = load_tokenizer(data.tokenizer)
    train: list[Examples] = []
    held: list[Examples] = []
    weights, names = [], []
    for number, entry in enumerate(data.mixture):
        field = "data.source" if data.sources is None else f"data.sources[{number}].path"
        if entry.path == SYNTHETIC:
            train.append(synthetic_rows(config, TRAIN_STREAM))
            weights.append(entry.weight)
            names.append(entry.path)
            held.append(synthetic_rows(config, VAL_STREAM))
            continue
        prepared = open_prepared(prepared_folder(entry.path, data, progress=progress, field=field), tokenizer)
        where = f"{field}={entry.path!r}" + ("" if is_prepared(entry.path) else f" (prepared in {prepared.folder})")
        examples, val = _examples(prepared, data, width, where, check)
        train.append(examples)
        weights.append(entry.weight)
        names.append(entry.path)
        if val is not None:
            held.append(val)
    if data.val_source == SYNTHETIC:
        held = [synthetic_rows(config, VAL_STREAM)]
    elif data.val_source is not None:
        field = "data.val_source"
        prepared = open_prepared(prepared_folder(data.val_source, data, progress=progress, field=field), tokenizer)
        examples, _ = _examples(prepared, data, width, f"data.val_source={data.val_source!r}", check)
        held = [examples]
    return RunData(train, weights, names, held[0] if len(held) == 1 else Concat(held))


def synthetic_rows(config: Config, stream: int) -> SyntheticTokens:
    """``data.source = "synthetic"``: seeded uniform rows over the model's vocabulary, as many as the run
    reads — one per example of every step (training) or of one evaluation (validation) — so no row repeats."""
    model, train = config.model, config.training
    batches = train.steps if stream == TRAIN_STREAM else max(config.eval.batches, 1)
    return SyntheticTokens(
        output_width(model),
        sequence_length(model) + 1,
        batches * train.global_batch_size,
        seed=train.seed,
        stream=stream,
        segments=config.data.document_mask,
    )


def check_language_data(config: Config) -> None:
    """Before any process starts: the tokenizer fits the model, every source is prepared (a progress bar
    while preparing), each split holds at least one global batch."""
    tokenizer, vocab = load_tokenizer(config.data.tokenizer), output_width(config.model)
    if tokenizer.vocab_size > vocab and not isinstance(tokenizer, ByteTokenizer):
        raise DataError(
            f"data.tokenizer={config.data.tokenizer!r} has {tokenizer.vocab_size} tokens, more than "
            f"model.vocab_size={vocab}; use vocab_size >= {tokenizer.vocab_size}"
        )
    data = language_data(config, progress=True, check=True)
    top, shard = _largest_token([*data.train, data.val])
    if top >= vocab and tokenizer.vocab_size > vocab:  # bytes: a small vocabulary fits data whose bytes stay below
        raise DataError(
            f"data.source={config.data.source!r} holds byte {top}, past model.vocab_size={vocab}; "
            f"use vocab_size >= {top + 1} ({tokenizer.vocab_size} fits any text)"
        )
    if top >= vocab:  # a shard changed after it was prepared, or a manifest that records a false tokenizer
        raise DataError(
            f"{shard} holds token id {top}, past model.vocab_size={vocab} (and the tokenizer's "
            f"{tokenizer.vocab_size}): the folder is damaged or was prepared with another tokenizer; prepare it again"
        )
    batch = config.training.global_batch_size
    what = f"examples of model.context_length+1={sequence_length(config.model) + 1} tokens"
    if len(data.train) == 1 and len(data.train[0]) < batch:  # a mixture draws one by one: any source serves
        raise DataError(
            f"data.source={data.names[0]!r} gives {len(data.train[0])} training {what}, fewer than one global batch "
            f"of {batch}; use a shorter context, a smaller training.global_batch_size or more data"
        )
    if not len(data.val):  # validation runs any number of examples, a partial last batch included
        source = config.data.val_source if config.data.val_source is not None else data.names[0]
        raise DataError(f"data source {source!r} gives no validation {what}; use a shorter context or more data")


SCAN_TOKENS = 1 << 31  # a split this small is read whole before launch (seconds); a larger one trusts its manifest


def _largest_token(examples: list[Examples]) -> tuple[int, Path | None]:
    """The largest id in the splits behind ``examples`` and the shard that holds it: read a block of tokens
    at a time, or for a split past :data:`SCAN_TOKENS` as the manifest records it (the workers check every
    batch anyway)."""
    splits = {id(s): s for e in examples for s in _splits_of(e)}.values()
    top, where = 0, None
    for split in splits:
        for number, shard in enumerate(split.shards):
            found = shard.max_token
            if found is None or split.tokens <= SCAN_TOKENS:
                base, found = int(split.token_starts[number]), 0
                for start in range(base, base + shard.tokens, 1 << 24):
                    block = split.read(start, min(base + shard.tokens, start + (1 << 24)))
                    found = max(found, int(block.max(initial=0)))
            if found >= top:
                top, where = found, split.folder / (shard.name + TOKENS)
    return top, where


def _splits_of(examples: Examples) -> list[Split]:
    if isinstance(examples, Concat):
        return [s for part in examples.parts for s in _splits_of(part)]
    return [examples.split] if isinstance(examples, (Windows, Documents)) else []
