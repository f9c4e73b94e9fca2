"""The prepared-dataset folder: its manifest, its file names, and the checks that make it safe to map.

A prepared dataset is a folder::

    manifest.json
    train-00000.tokens   train-00000.docs   [train-00000.mask]
    train-00001.tokens   ...
    val-00000.tokens     ...

Each split (``train``, and ``val`` when documents were held out) is a list of shards; a shard holds
whole documents, never part of one. ``.tokens`` is the token ids end to end (``uint16`` when the
vocabulary fits, else ``uint32``, little-endian, no header); ``.docs`` the offset of each document's
first token within the shard (``int64``, the first is 0); ``.mask`` (pairs and preferences only) one
byte per token, 1 where the loss counts it (response tokens); for DPO's preference pairs (kind
``preferences``, one pair per document: prompt, chosen, rejected end to end) the byte says which of the
three a token belongs to (:mod:`polyshard.data.preference_rows`). The split's token stream is its shards
end to end. A text document ends with the tokenizer's end-of-text token or, when the tokenizer has
none (the byte tokenizer), with the manifest's ``separator`` bytes; a pair's responses end as its rule says.

The manifest is untrusted input: :func:`read_manifest` checks every field, that file names are bare
names inside the folder, and that each file's size is what the manifest says, before anything is
mapped. It records the tokenizer (name, sha256, vocabulary, end-of-text id) so a run with another
tokenizer is refused, and the sources (names, sizes, sha256) so a folder says where it came from.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polyshard.data.errors import DataError
from polyshard.data.tokenizer import BYTES, FileTokenizer, Tokenizer

FORMAT = "polyshard.prepared"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
KINDS = ("text", "pairs", "preferences")  # documents; prompt/response with a loss mask; DPO pairs (a side mask)
MASKED = ("pairs", "preferences")  # the kinds with a .mask file: one byte per token
DOCS_DTYPE = np.dtype("<i8")
MASK_DTYPE = np.dtype("u1")
TOKENS = ".tokens"
DOCS = ".docs"
MASK = ".mask"
_BARE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_MANIFEST_LIMIT = 64 << 20  # a manifest lists shards and sources; far larger is not one of ours


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """The narrowest unsigned dtype that holds every id of the vocabulary."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def dtype_name(dtype: np.dtype[Any]) -> str:
    return {np.dtype("<u2"): "uint16", np.dtype("<u4"): "uint32"}[dtype]


_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclass(frozen=True)
class TokenizerInfo:
    name: str
    """'bytes', or the tokenizer file's name."""
    sha256: str
    """sha256 of the tokenizer.json bytes; 'bytes' for the byte tokenizer."""
    vocab_size: int
    end_of_text: int | None


def tokenizer_info(tokenizer: Tokenizer) -> TokenizerInfo:
    """What a manifest records of ``tokenizer``, so a run can tell whether it is the same one."""
    if isinstance(tokenizer, FileTokenizer):
        digest = hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()
        return TokenizerInfo(tokenizer.path.name, digest, tokenizer.vocab_size, tokenizer.end_of_text)
    return TokenizerInfo(BYTES, BYTES, tokenizer.vocab_size, tokenizer.end_of_text)


@dataclass(frozen=True)
class SourceInfo:
    name: str
    """The source file as given (a path, or a dataset name)."""
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ShardInfo:
    name: str
    """The bare file stem: ``<name>.tokens``, ``<name>.docs``, ``<name>.mask``."""
    tokens: int
    documents: int
    max_token: int | None = None
    """The largest token id in the shard (None in folders written before it was recorded)."""


@dataclass(frozen=True)
class SplitInfo:
    shards: tuple[ShardInfo, ...]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)


@dataclass(frozen=True)
class Manifest:
    kind: str
    dtype: str
    tokenizer: TokenizerInfo
    separator: str | None
    """Text appended after each document when the tokenizer has no end-of-text token (None otherwise)."""
    sources: tuple[SourceInfo, ...]
    val_fraction: float
    """Share of documents held out for validation, chosen by :func:`held_out` with ``seed``."""
    seed: int
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return _DTYPES[self.dtype]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.splits.values())

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.splits.values())

    def to_json(self) -> str:
        """The manifest as JSON; each split also states its token and document counts (for readers:
        the shards' own counts are what is checked)."""
        raw = asdict(self)
        for name, split in self.splits.items():
            raw["splits"][name].update(tokens=split.tokens, documents=split.documents)
        return json.dumps(raw, indent=1) + "\n"

    def write(self, folder: Path) -> None:
        """Write ``manifest.json`` into ``folder`` whole or not at all."""
        tmp = folder / (MANIFEST + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(folder / MANIFEST)


def held_out(seed: int, documents: np.ndarray, fraction: float) -> np.ndarray:
    """Whether each document number is held out for validation: a seeded hash (splitmix64) of the
    number below ``fraction``, so the choice depends on nothing but the seed and the document's place.
    Document 0 always trains, so no corpus is held out whole."""
    with np.errstate(over="ignore"):
        z = documents.astype(np.uint64) + np.uint64(seed & (2**64 - 1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    held: np.ndarray = ((z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction) & (documents != 0)
    return held


# -- reading ---------------------------------------------------------------------------------------


def read_manifest(folder: Path) -> Manifest:
    """The checked manifest of the prepared dataset in ``folder``; every file it names exists with the
    size it should have. A :class:`DataError` naming the file and the fix otherwise."""
    path = folder / MANIFEST
    again = f"prepare it again with `polyshard prepare SOURCE {folder}`"
    if not path.is_file():
        raise DataError(f"{folder} is not a prepared dataset: no {MANIFEST}; {again}")
    check_inside(folder, path)
    if path.stat().st_size > _MANIFEST_LIMIT:
        raise DataError(f"{path} is {path.stat().st_size} bytes, far larger than a manifest; {again}")
    raw = read_json(path, f"; {again}")
    manifest = _parse(raw, path, again)
    for info in manifest.splits.values():
        for shard in info.shards:
            _check_size(folder, shard.name + TOKENS, shard.tokens * manifest.np_dtype.itemsize, again)
            _check_size(folder, shard.name + DOCS, shard.documents * DOCS_DTYPE.itemsize, again)
            if manifest.kind in MASKED:
                _check_size(folder, shard.name + MASK, shard.tokens * MASK_DTYPE.itemsize, again)
    return manifest


def read_json(path: Path, fix: str) -> Any:
    """``path`` parsed as JSON; a :class:`DataError` (``fix`` appended) for bytes that are not JSON,
    not UTF-8, or nested too deeply for the parser (a RecursionError otherwise)."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path} is not JSON ({err}){fix}") from err
    except RecursionError as err:
        raise DataError(f"{path} is JSON nested too deeply to be a manifest{fix}") from err


def check_inside(folder: Path, path: Path) -> None:
    """A file of a prepared folder is read only where it lies inside the folder: a link to a file
    elsewhere is refused (nothing outside the folder the user named is read)."""
    target = path.resolve()
    if not target.is_relative_to(folder.resolve()):
        raise DataError(
            f"{path} is a link to {target}, outside the prepared folder {folder}; copy the file into the folder "
            "(or prepare the dataset again)"
        )


def _check_size(folder: Path, name: str, expected: int, again: str) -> None:
    path = folder / name
    if not path.is_file():
        raise DataError(f"{path} is missing; the manifest names it; {again}")
    check_inside(folder, path)
    size = path.stat().st_size
    if size != expected:
        raise DataError(f"{path} holds {size} bytes, the manifest says {expected}; {again}")


def _parse(raw: Any, path: Path, again: str) -> Manifest:
    def bad(what: str) -> DataError:
        return DataError(f"{path}: {what}; {again}")

    def get(obj: Any, key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise bad(f"no {where}{key!r} field")
        value = obj[key]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise bad(f"{where}{key!r} is {value!r}, of the wrong type")
        return value

    def count(obj: Any, key: str, where: str) -> int:
        value: int = get(obj, key, int, where)
        if value < 0:
            raise bad(f"{where}{key!r} is {value}, below 0")
        return value

    if get(raw, "format", str) != FORMAT:
        raise bad(f"format {raw['format']!r} is not {FORMAT!r}")
    if get(raw, "version", int) != VERSION:
        raise bad(f"format version {raw['version']} is not {VERSION}, the one this polyshard reads")
    kind = get(raw, "kind", str)
    if kind not in KINDS:
        raise bad(f"kind {kind!r} is not one of {KINDS}")
    dtype = get(raw, "dtype", str)
    if dtype not in _DTYPES:
        raise bad(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    tok = get(raw, "tokenizer", dict)
    eot = tok.get("end_of_text")
    if eot is not None and (not isinstance(eot, int) or isinstance(eot, bool) or eot < 0):
        raise bad(f"tokenizer.end_of_text is {eot!r}, not a token id")
    tokenizer = TokenizerInfo(
        get(tok, "name", str, "tokenizer."),
        get(tok, "sha256", str, "tokenizer."),
        count(tok, "vocab_size", "tokenizer."),
        eot,
    )
    if token_dtype(tokenizer.vocab_size).itemsize > _DTYPES[dtype].itemsize:
        raise bad(f"dtype {dtype} cannot hold the ids of a {tokenizer.vocab_size}-token vocabulary")
    separator = raw.get("separator")
    if separator is not None and not isinstance(separator, str):
        raise bad(f"separator is {separator!r}, not a string")
    sources = tuple(
        SourceInfo(
            get(s, "name", str, "sources[]."), count(s, "bytes", "sources[]."), get(s, "sha256", str, "sources[].")
        )
        for s in get(raw, "sources", list)
    )
    fraction = get(raw, "val_fraction", (int, float))
    if not 0.0 <= fraction < 1.0:
        raise bad(f"val_fraction is {fraction}, not in [0, 1)")
    seed = get(raw, "seed", int)
    splits: dict[str, SplitInfo] = {}
    names: set[str] = set()
    for split, value in get(raw, "splits", dict).items():
        if split not in SPLITS:
            raise bad(f"split {split!r} is not one of {SPLITS}")
        shards = []
        for shard in get(value, "shards", list, f"splits.{split}."):
            where = f"splits.{split}.shards[]."
            name = get(shard, "name", str, where)
            if not _BARE.match(name) or name in names:
                raise bad(f"shard name {name!r} is not a bare file name (letters, digits, '_', '.', '-') or repeats")
            names.add(name)
            top = shard.get("max_token")
            if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top):
                raise bad(f"shard {name!r}: max_token is {top!r}, not a token id")
            if top is not None and top >= tokenizer.vocab_size:
                raise bad(f"shard {name!r} holds token {top}, past the tokenizer's {tokenizer.vocab_size}")
            info = ShardInfo(name, count(shard, "tokens", where), count(shard, "documents", where), top)
            if info.tokens and not info.documents or info.documents > info.tokens:
                raise bad(f"shard {name!r} holds {info.tokens} tokens in {info.documents} documents")
            shards.append(info)
        splits[split] = SplitInfo(tuple(shards))
    if "train" not in splits or not splits["train"].tokens:
        raise bad("no training tokens")
    return Manifest(kind, dtype, tokenizer, separator, sources, float(fraction), seed, splits)
