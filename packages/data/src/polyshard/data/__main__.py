"""``polyshard-data`` (or ``python -m polyshard.data``): prepared datasets without the trainer.

polyshard-data prepare corpus/ data/corpus --tokenizer tokenizer.json     text files, one document each
polyshard-data prepare chat.jsonl data/chat --kind pairs                    prompt/response pairs, with a mask
polyshard-data prepare prefs.jsonl data/prefs --kind preferences --tokenizer tok/   DPO pairs, one per document
"""

from __future__ import annotations

import argparse
import sys

from polyshard.data.errors import DataError
from polyshard.data.format import KINDS, Manifest
from polyshard.data.prepare import DEFAULT_SHARD_TOKENS, prepare
from polyshard.data.sources import DOCUMENT_LIMIT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="polyshard-data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize a corpus once into memory-mappable shards")
    p.add_argument("source", help=".txt/.jsonl[.gz|.zst]/.parquet file or folder, save_to_disk folder, dataset name")
    p.add_argument("out", help="the prepared-dataset folder to write")
    p.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json (or a folder holding one)")
    p.add_argument("--kind", choices=KINDS, default="text", help="documents, prompt/response pairs or DPO pairs")
    p.add_argument("--split-on", choices=("file", "blank"), default="file", help="a .txt document: a file or a block")
    p.add_argument("--text-field", default="text")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--response-field", default="response")
    p.add_argument("--separator", default="\n", help="ends each document when the tokenizer has no end-of-text")
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: every core)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    p.add_argument("--overwrite", action="store_true", help="replace a prepared dataset already at OUT")
    p.add_argument("--max-document-mb", type=int, default=DOCUMENT_LIMIT >> 20, help="a longer document is refused")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        manifest = prepare(
            args.source, args.out, args.tokenizer, kind=args.kind, split_on=args.split_on,
            text_field=args.text_field, prompt_field=args.prompt_field, response_field=args.response_field,
            separator=args.separator, val_fraction=args.val_fraction, seed=args.seed, workers=args.workers,
            shard_tokens=args.shard_tokens, overwrite=args.overwrite, progress=not args.quiet,
            max_document_bytes=args.max_document_mb << 20, note=lambda line: print(line, file=sys.stderr),
        )  # fmt: skip
    except DataError as err:
        print(f"data error: {err}", file=sys.stderr)
        return 2
    print(summary(manifest, args.out))
    return 0


def summary(manifest: Manifest, out: str) -> str:
    """One line per split: documents, tokens, shards."""
    lines = [f"wrote {out} ({manifest.dtype}, {len(manifest.sources)} source files)"]
    for name, split in manifest.splits.items():
        lines.append(f"  {name}: {split.documents:,} documents, {split.tokens:,} tokens, {len(split.shards)} shards")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
