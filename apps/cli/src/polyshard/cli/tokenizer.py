"""``polyshard tokenizer``: train a byte-level BPE on a text source, for ``data.tokenizer``."""

from __future__ import annotations

from pathlib import Path

import typer

from polyshard.cli.errors import fail


def tokenizer_command(
    source: str = typer.Argument(
        ...,
        help="'shakespeare', or what prepare reads: a .txt/.jsonl[.gz|.zst]/.parquet file or folder, a "
        "save_to_disk folder, or a dataset name.",
    ),
    out: Path = typer.Argument(..., help="The tokenizer.json to write."),
    # No typer range: train_bpe says why below 257 fails, in one line (typer would print a usage box).
    vocab_size: int = typer.Option(
        4096, "--vocab-size", help="Tokens: the 256 bytes, the merges and the end-of-text token (257 or more)."
    ),
    kind: str = typer.Option("text", "--kind", help="text (documents), or pairs: trains on prompts and responses."),
    text_field: str = typer.Option("text", "--text-field", help="The field (column) holding the text."),
    prompt_field: str = typer.Option("prompt", "--prompt-field", help="--kind pairs: the prompt's field."),
    response_field: str = typer.Option("response", "--response-field", help="--kind pairs: the response's field."),
    split_on: str = typer.Option("file", "--split-on", help="A .txt document: the file, or each blank-line block."),
    max_document_mb: int = typer.Option(
        16, "--max-document-mb", help="A longer document (file, block, line or row) is refused: memory stays bounded."
    ),
) -> None:
    """Train a byte-level BPE (GPT-2's kind: every string round-trips, <|endoftext|> ends each document)
    and save it as tokenizer.json; then train with --set data.tokenizer=OUT --set model.vocab_size=N
    (N at least --vocab-size)."""
    from polyshard.data.sources import Fields
    from polyshard.data.texts import source_texts
    from polyshard.trainer import DataError, local_files, train_bpe

    try:
        if out.is_dir():
            raise DataError(f"{out} is a folder; give the file to write, e.g. {out / 'tokenizer.json'}")
        if not out.parent.is_dir():
            raise DataError(f"{out.parent} does not exist; create it or choose another destination")
        fields = Fields(kind, split_on, text_field, prompt_field, response_field, max_document_mb << 20)
        sources = [str(f) for f in local_files(source) or []] if source == "shakespeare" else [source]
        texts = [source_texts(spec, fields) for spec in sources]  # each checked here, before training starts
        written = train_bpe((text for each in texts for text in each), vocab_size, out)
    except DataError as err:
        fail("data", err)
    typer.echo(f"wrote {written} ({_size(written)} tokens, <|endoftext|> included)")


def _size(path: Path) -> int:
    from polyshard.trainer import load_tokenizer

    return load_tokenizer(str(path)).vocab_size
