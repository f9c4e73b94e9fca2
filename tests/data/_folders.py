"""A plain writer of prepared folders for tests of the reader: documents in, the format's files out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from polyshard.data.format import DOCS, MASK, TOKENS, Manifest, ShardInfo, SplitInfo, TokenizerInfo

BYTES_INFO = TokenizerInfo("bytes", "bytes", 256, None)


def write_folder(
    folder: Path,
    splits: dict[str, list[list[list[int]]]],
    *,
    masks: dict[str, list[list[list[int]]]] | None = None,
    tokenizer: TokenizerInfo = BYTES_INFO,
    dtype: str = "uint16",
) -> Manifest:
    """``splits[name]`` is a list of shards, each a list of documents (token lists); ``masks`` the same
    shape of 0/1 lists for a pairs folder."""
    folder.mkdir(parents=True, exist_ok=True)
    infos = {}
    for split, shards in splits.items():
        shard_infos = []
        for number, docs in enumerate(shards):
            name = f"{split}-{number:05d}"
            tokens = np.asarray([t for d in docs for t in d], dtype=dtype)
            tokens.tofile(folder / (name + TOKENS))
            np.cumsum([0] + [len(d) for d in docs[:-1]], dtype="<i8").tofile(folder / (name + DOCS))
            if masks is not None:
                np.asarray([m for d in masks[split][number] for m in d], dtype="u1").tofile(folder / (name + MASK))
            shard_infos.append(ShardInfo(name, len(tokens), len(docs)))
        infos[split] = SplitInfo(tuple(shard_infos))
    kind = "pairs" if masks is not None else "text"
    manifest = Manifest(kind, dtype, tokenizer, "\n" if kind == "text" else None, (), 0.1, 0, infos)
    manifest.write(folder)
    return manifest
